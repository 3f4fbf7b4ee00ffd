"""The profile report as plain data: sections of tables, key numbers, plot series and recommendations.

A leaf module (nothing of ``gem_model`` is imported here), so plugin packages can build
:class:`ProfileSection` objects without importing the trainer. Everything round-trips through JSON
(:meth:`ProfileReport.to_json` / :meth:`ProfileReport.from_json`): ``gem-train report RUN_DIR``
re-renders tables, plots and HTML from ``profile.json`` alone.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEMA_VERSION = 1


@dataclass
class ProfileTable:
    """A titled table; cells are numbers or strings (``None`` prints as ``-``)."""

    title: str
    columns: list[str]
    rows: list[list[Any]]


@dataclass
class Recommendation:
    """One suggested change, with what it should buy and the numbers that say so."""

    action: str
    """What to change, as a config override where there is one (``data.balancer=seq_balanced``)."""
    expected_gain: float
    """Expected fraction saved of ``metric`` (0.25: a quarter less); recommendations are ranked by it."""
    metric: str
    """What the gain is measured in: ``step time``, ``memory per rank``, ``attention work``..."""
    evidence: str
    """The numbers behind it, in words."""
    section: str = ""
    """The section that made it (filled by the report)."""


@dataclass
class ProfileSection:
    """One section of the profile. Plugins return these from ``gem_profile_sections``.

    - ``name``: a lowercase key (``sequences``, ``numerics``); unique within a report.
    - ``summary``: the section's key numbers by name (what tests and ``tune`` read).
    - ``tables``: what the terminal and HTML show.
    - ``series``: named lists of numbers for the plots (``plots.py`` knows which it draws).
    - ``recommendations``: changes this section's numbers suggest.
    - ``notes``: sentences shown under the tables (what was not measured, and why).
    """

    name: str
    title: str
    summary: dict[str, Any] = field(default_factory=dict)
    tables: list[ProfileTable] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)
    recommendations: list[Recommendation] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class ProfileReport:
    config_name: str
    device: str
    created: str
    """UTC time the profile was taken, ISO 8601."""
    command: str
    sections: list[ProfileSection]
    config: dict[str, Any] = field(default_factory=dict)
    """The resolved run config (``RunConfig.model_dump(mode="json")``)."""
    schema_version: int = SCHEMA_VERSION

    def section(self, name: str) -> ProfileSection:
        for s in self.sections:
            if s.name == name:
                return s
        raise KeyError(f"the profile has no section {name!r}; it has {[s.name for s in self.sections]}")

    def has(self, name: str) -> bool:
        return any(s.name == name for s in self.sections)

    def to_json(self) -> str:
        return json.dumps(_finite(asdict(self)), indent=1, allow_nan=False)

    @classmethod
    def from_json(cls, text: str) -> ProfileReport:
        """The report of a ``profile.json``; a missing or mistyped field raises ``ValueError`` naming it."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("profile.json: the top level must be an object")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ValueError(f"profile.json has schema_version {version!r}; this gem-model reads {SCHEMA_VERSION}")
        sections = []
        for i, s in enumerate(_field(data, "sections", "profile.json", list)):
            where = f"profile.json: sections[{i}]" + (f" ({s.get('name')!r})" if isinstance(s, dict) and "name" in s else "")
            if not isinstance(s, dict):
                raise ValueError(f"{where} is not an object")
            try:
                sections.append(ProfileSection(
                    name=_field(s, "name", where, str), title=_field(s, "title", where, str),
                    summary=_field(s, "summary", where, dict),
                    tables=[ProfileTable(**t) for t in _field(s, "tables", where, list)],
                    series=_field(s, "series", where, dict),
                    recommendations=[Recommendation(**r) for r in _field(s, "recommendations", where, list)],
                    notes=_field(s, "notes", where, list),
                ))  # fmt: skip
            except TypeError as exc:  # a table or recommendation with a field missing or unknown
                raise ValueError(f"{where}: {exc}") from None
        return cls(
            config_name=_field(data, "config_name", "profile.json", str), device=_field(data, "device", "profile.json", str),
            created=_field(data, "created", "profile.json", str), command=_field(data, "command", "profile.json", str),
            sections=sections, config=data.get("config", {}),
        )  # fmt: skip


def _field(data: dict[str, Any], key: str, where: str, kind: type) -> Any:
    if key not in data:
        raise ValueError(f"{where} has no field {key!r}")
    if not isinstance(data[key], kind):
        raise ValueError(f"{where}: field {key!r} is a {type(data[key]).__name__}, not a {kind.__name__}")
    return data[key]


def _finite(value: Any) -> Any:
    """Strict JSON has no NaN or Infinity: they become None (not measured / unbounded)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
