"""What ``gem-train plugins`` prints: distributions, the hooks each plugin implements, every
registered name with its provider, and the names two plugins clash on (only a run that selects a
clashing name fails; listing the plugins keeps working)."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from gem_model.plugins import REGISTRY_SPECS, GemPluginManager
from gem_model.registry import Registry


def _registries(pm: GemPluginManager) -> list[Registry]:
    regs = pm.registries
    return [regs[attr] for attr in REGISTRY_SPECS] + [r for _, r in sorted(regs["kernels"].items())]


def plugins_report(pm: GemPluginManager, *, options: bool = False) -> str:
    """The report; ``options``: under each name, its options (type, default, description)."""
    lines = ["installed plugin distributions:"]
    hooks = pm.hooks_by_plugin()
    for (dist, version), plugins in pm.distributions().items():
        lines.append(f"  {dist} {version}")
        for plugin in plugins:
            lines.append(f"    plugin {plugin}: {', '.join(hooks.get(plugin, [])) or 'no hooks'}")
    registries = _registries(pm)
    width = max((len(n) for r in registries for n in [*r.names(), *r.clashes()]), default=12)
    clashes: list[str] = []
    for registry in registries:
        if not len(registry) and not registry.clashes():
            continue
        lines.append(f"\n{registry.config_path}:")
        for name, entry in registry.entries().items():
            lines.append(f"  {name:<{width}}  from {entry.provider.distribution} {entry.provider.version}")
            if options:
                lines += [f"      {line}" for line in option_lines(entry.cls.Config)]
        for name, providers in registry.clashes().items():
            by = ", ".join(f"{p.distribution} {p.version}" for p in providers)
            lines.append(f"  {name:<{width}}  CLASH: registered by {by}")
            clashes.append(registry.clash_message(name))
    commands = profile_commands(pm)
    if commands:
        lines.append("\ngem-train profile subcommands from plugins:")
        lines += [f"  {name:<{width}}  {help}" for name, help in commands.items()]
    if clashes:
        lines.append("\nname clashes (a run that selects one of these names fails):")
        lines += [f"  {c}" for c in clashes]
    return "\n".join(lines)


def profile_commands(pm: GemPluginManager) -> dict[str, str]:
    """Name -> help of every ``gem-train profile`` subcommand the plugins add."""
    return {c.name: c.help for group in pm.call("gem_profile_commands") for c in group or ()}


def option_lines(config: type[BaseModel]) -> list[str]:
    """``name (type, default D): description`` of every option of a component's ``Config``; nested
    settings as ``outer.inner``, those of list items as ``outer[].inner``."""
    rows = [f"{n} ({t}, {'required' if d is None else 'default ' + d})" + (f": {doc}" if doc else "")
            for n, t, d, doc in _options(config, "")]  # fmt: skip
    return rows or ["(no options)"]


def _options(model: type[BaseModel], prefix: str) -> typing.Iterator[tuple[str, str, str | None, str]]:
    for name, field in model.model_fields.items():
        default = None if field.is_required() else _default(field)
        yield prefix + name, _type_name(field.annotation), default, " ".join((field.description or "").split())
        inner, many = _nested(field.annotation)
        if inner is not None:
            yield from _options(inner, f"{prefix}{name}{'[]' if many else ''}.")


def _default(field: Any) -> str:
    value = field.get_default(call_default_factory=True) if field.default is PydanticUndefined else field.default
    if isinstance(value, BaseModel):
        return "(see below)"
    return repr(value)


def _nested(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    origin = typing.get_origin(annotation)
    if origin in (list, tuple):
        inner, _ = _nested(typing.get_args(annotation)[0])
        return inner, True
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(annotation):
            inner, many = _nested(arg)
            if inner is not None:
                return inner, many
    return None, False


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("NoneType", "None")
