"""Reading a run config: a YAML or TOML file plus ``key.sub=value`` overrides.

Every problem becomes a :class:`~gem_model.errors.ConfigError` carrying the dotted field path and
the bad value, raised before any process group exists. Problems are collected, not raised one at a
time: a file's duplicate keys, every malformed override and every field pydantic refuses come back
together (:mod:`gem_model.checks` adds the names, options and constraints to the same round).
"""

from __future__ import annotations

import difflib
import json
import tomllib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gem_model.config import RunConfig
from gem_model.errors import ConfigError

Problem = tuple[str, object, str]


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (YAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError([("<file>", key, f"key {key!r} is given twice in one mapping (lines {seen[key]} "
                                    f"and {line}; YAML would keep the last silently): keep one")])  # fmt: skip
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _text(p: Path) -> str:
    raw = p.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            [("<file>", str(p), f"is not UTF-8 text: byte 0x{raw[exc.start]:02x} at offset {exc.start} (line {line}); "
              "save the file as UTF-8")]
        ) from None  # fmt: skip


def read_file(path: str | Path) -> dict[str, Any]:
    """Parse a ``.yaml``/``.yml`` or ``.toml`` file (UTF-8, no key given twice) into a dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([("<file>", str(path), "config file not found")])
    if p.suffix not in (".yaml", ".yml", ".toml"):
        raise ConfigError([("<file>", str(path), "config files must end in .yaml, .yml or .toml")])
    text = _text(p)
    try:
        if p.suffix == ".toml":
            data = tomllib.loads(text)  # TOML itself refuses a key defined twice
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # a SafeLoader subclass
    except ConfigError as exc:
        raise ConfigError([(str(path), v, m) for _, v, m in exc.problems]) from None
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError([("<file>", str(path), f"cannot parse: {exc}")]) from exc
    if not isinstance(data, dict):
        raise ConfigError([("<file>", str(path), "the top level must be a mapping")])
    return data


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` items (value parsed as YAML: ``3``, ``true``, ``[1, 2]``, ``bf16``).

    Raises one :class:`ConfigError` listing every malformed override."""
    out, problems = apply_overrides_collecting(data, overrides)
    if problems:
        raise ConfigError(problems)
    return out


def apply_overrides_collecting(data: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[str, Any], list[Problem]]:
    """:func:`apply_overrides` that returns the malformed overrides' problems beside the data (those are left out)."""
    out = json.loads(json.dumps(data))  # deep copy of plain data
    defaults = RunConfig().model_dump(mode="json")
    problems: list[Problem] = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            problems.append((item, item, "an override must look like key.sub=value"))
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            problems.append((key, raw, f"cannot parse the value: {exc}"))
            continue
        problem = _set(out, defaults, key.strip().split("."), value)
        if problem is not None:
            problems.append(problem)
    return out, problems


def _set(out: dict[str, Any], defaults: dict[str, Any], parts: list[str], value: Any) -> Problem | None:
    node, default = out, defaults
    for i, part in enumerate(parts[:-1]):
        default = default.get(part) if isinstance(default, dict) else None
        child = node.get(part)
        if isinstance(child, str) and isinstance(default, dict) and "name" in default:
            child = {"name": child}  # `scheme: bf16` given as a plain string, now with options
        elif child is None:
            # a section the file left out: start from the default component's name, if any
            child = {"name": default["name"]} if isinstance(default, dict) and "name" in default else {}
        if not isinstance(child, dict):
            return (".".join(parts[: i + 1]), child, "is not a mapping, cannot set a sub-key")
        node[part] = child
        node = child
    node[parts[-1]] = value
    return None


def validate(data: dict[str, Any], model: type[BaseModel] = RunConfig, prefix: str = "") -> Any:
    """Validate ``data`` against ``model``; problems are reported with dotted paths."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(problems_of(exc, model, prefix)) from None


def problems_of(exc: ValidationError, model: type[BaseModel], prefix: str = "") -> list[Problem]:
    """Each pydantic error as (dotted path, bad value, message); an unknown key's message lists the valid ones."""
    out = []
    for err in exc.errors():
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg += valid_keys_hint(model, err["loc"])
        out.append((_dotted(prefix, err["loc"]), err.get("input"), msg))
    return out


def valid_keys_hint(model: type[BaseModel], loc: Sequence[int | str]) -> str:
    """``; valid keys here: a, b (did you mean a?)`` for the unknown key at ``loc`` of ``model``."""
    owner = _model_at(model, list(loc[:-1]))
    if owner is None:
        return ""
    keys = sorted(owner.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
    return f"; valid keys here: {', '.join(keys) or '(none)'}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _model_at(model: type[BaseModel], loc: list[int | str]) -> type[BaseModel] | None:
    """The pydantic model that holds the value at ``loc`` inside ``model`` (None when not a model)."""
    current: Any = model
    for part in loc:
        if isinstance(part, int) or part in ("function-after", "function-before"):
            continue  # a list index, or pydantic's name for a validator's step
        if not (isinstance(current, type) and issubclass(current, BaseModel)) or part not in current.model_fields:
            return None
        current = _inner_model(current.model_fields[part].annotation)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _inner_model(annotation: Any) -> Any:
    """The model class inside ``X``, ``X | None``, ``list[X]`` or ``dict[str, X]``; else the annotation."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, list, tuple, dict):
        for arg in typing.get_args(annotation):
            found = _inner_model(arg)
            if isinstance(found, type) and issubclass(found, BaseModel):
                return found
    return annotation


def _dotted(prefix: str, loc: Sequence[int | str]) -> str:
    parts = [str(p) for p in loc if p not in ("function-after", "function-before")]
    return ".".join([prefix, *parts] if prefix else parts) or "<root>"


def validate_leniently(data: dict[str, Any]) -> tuple[RunConfig | None, list[Problem]]:
    """Every schema problem of ``data``, and a config in which each refused field falls back to its
    default, so that the names, options and constraints of the rest can be checked in the same round.
    None when no such config can be made."""
    try:
        return RunConfig.model_validate(data), []
    except ValidationError as exc:
        problems = problems_of(exc, RunConfig)
        errors = exc.errors()
    patched = json.loads(json.dumps(data, default=str))
    for _ in range(4):  # a fallback can only uncover errors above it, never loop
        for err in errors:
            _drop(patched, [p for p in err["loc"] if p not in ("function-after", "function-before")])
        try:
            return RunConfig.model_validate(patched), problems
        except ValidationError as again:
            errors = again.errors()
    return None, problems


def _drop(data: Any, loc: list[int | str]) -> None:
    """Remove the value at ``loc`` (or the nearest key above it that exists), so its default applies."""
    node = data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, dict) and part in node:
            if last or not isinstance(node[part], (dict, list)):
                del node[part]
                return
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            if last:
                del node[part]
                return
            node = node[part]
        else:
            return
    if isinstance(data, dict) and loc and loc[0] in data:  # a validator of a whole section refused it
        del data[loc[0]]


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The run config from an optional file and overrides; defaults are the tiny CPU run."""
    data = read_file(path) if path is not None else {}
    return validate(apply_overrides(data, overrides))


def dump(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
