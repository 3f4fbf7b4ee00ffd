"""Reading a run config: a YAML or TOML file plus ``key.sub=value`` overrides.

Every problem becomes a :class:`~gem_model.errors.ConfigError` carrying the dotted field path and
the bad value, raised before any process group exists.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from gem_model.config import RunConfig
from gem_model.errors import ConfigError


def read_file(path: str | Path) -> dict[str, Any]:
    """Parse a ``.yaml``/``.yml`` or ``.toml`` file into a dict."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([("<file>", str(path), "config file not found")])
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif p.suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError([("<file>", str(path), "config files must end in .yaml, .yml or .toml")])
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError([("<file>", str(path), f"cannot parse: {exc}")]) from exc
    if not isinstance(data, dict):
        raise ConfigError([("<file>", str(path), "the top level must be a mapping")])
    return data


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` items (value parsed as YAML: ``3``, ``true``, ``[1, 2]``, ``bf16``)."""
    out = json.loads(json.dumps(data))  # deep copy of plain data
    defaults = RunConfig().model_dump(mode="json")
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([(item, item, "an override must look like key.sub=value")])
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            raise ConfigError([(key, raw, f"cannot parse the value: {exc}")]) from exc
        node, default = out, defaults
        parts = key.strip().split(".")
        for i, part in enumerate(parts[:-1]):
            default = default.get(part) if isinstance(default, dict) else None
            child = node.get(part)
            if isinstance(child, str) and isinstance(default, dict) and "name" in default:
                child = {"name": child}  # `scheme: bf16` given as a plain string, now with options
            elif child is None:
                # a section the file left out: start from the default component's name, if any
                child = {"name": default["name"]} if isinstance(default, dict) and "name" in default else {}
            if not isinstance(child, dict):
                raise ConfigError([(".".join(parts[: i + 1]), child, "is not a mapping, cannot set a sub-key")])
            node[part] = child
            node = child
        node[parts[-1]] = value
    return out


def validate(data: dict[str, Any], model: type[BaseModel] = RunConfig, prefix: str = "") -> Any:
    """Validate ``data`` against ``model``; problems are reported with dotted paths."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(
            [(_dotted(prefix, err["loc"]), err.get("input"), err["msg"]) for err in exc.errors()]
        ) from None


def _dotted(prefix: str, loc: Sequence[int | str]) -> str:
    parts = [str(p) for p in loc if p not in ("function-after", "function-before")]
    return ".".join([prefix, *parts] if prefix else parts) or "<root>"


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """The run config from an optional file and overrides; defaults are the tiny CPU run."""
    data = read_file(path) if path is not None else {}
    return validate(apply_overrides(data, overrides))


def dump(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
