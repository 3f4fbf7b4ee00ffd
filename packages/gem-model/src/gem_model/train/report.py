"""The end-of-run summary and its printed table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReportSection:
    """A titled list of (label, value) rows; plugins add sections through ``gem_report_sections``."""

    title: str
    rows: list[tuple[str, str]]


@dataclass
class RunSummary:
    name: str
    steps: int
    first_loss: float
    last_loss: float
    wall_seconds: float
    samples_per_s: float
    tokens_per_s: float
    mfu: float
    peak_flops: float
    peak_source: str
    world_size: int
    device: str
    components: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)

    def section(self) -> ReportSection:
        rows = [
            ("run", self.name),
            ("steps", str(self.steps)),
            ("loss (first -> last)", f"{self.first_loss:.4f} -> {self.last_loss:.4f}"),
            ("wall time", f"{self.wall_seconds:.1f} s"),
            ("samples / s", f"{self.samples_per_s:,.0f}"),
            ("tokens / s", f"{self.tokens_per_s:,.0f}"),
            ("MFU", f"{100 * self.mfu:.2f} % of {self.peak_flops / 1e12:.3g} TFLOP/s x {self.world_size} ({self.peak_source})"),
            ("processes", f"{self.world_size} on {self.device}"),
        ]
        rows += [(k, v) for k, v in self.components.items()]
        for key, value in sorted((self.extra.get("eval") or {}).items()):
            rows.append((key, f"{value:.4f}"))
        plan = str(self.extra.get("plan", "")).splitlines()
        if plan:
            rows.append(("placement", plan[0]))
        return ReportSection("summary", rows)


def format_sections(sections: list[ReportSection]) -> str:
    width = max((len(label) for s in sections for label, _ in s.rows), default=10)
    lines: list[str] = []
    for s in sections:
        lines.append(f"== {s.title} " + "=" * max(0, 60 - len(s.title)))
        lines += [f"  {label:<{width}}  {value}" for label, value in s.rows]
    return "\n".join(lines)
