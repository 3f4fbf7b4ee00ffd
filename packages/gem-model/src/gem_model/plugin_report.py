"""What ``gem-train plugins`` prints: distributions, the hooks each plugin implements, every
registered name with its provider, and the names two plugins clash on (only a run that selects a
clashing name fails; listing the plugins keeps working)."""

from __future__ import annotations

from gem_model.plugins import REGISTRY_SPECS, GemPluginManager
from gem_model.registry import Registry


def _registries(pm: GemPluginManager) -> list[Registry]:
    regs = pm.registries
    return [regs[attr] for attr in REGISTRY_SPECS] + [r for _, r in sorted(regs["kernels"].items())]


def plugins_report(pm: GemPluginManager) -> str:
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
        for name, providers in registry.clashes().items():
            by = ", ".join(f"{p.distribution} {p.version}" for p in providers)
            lines.append(f"  {name:<{width}}  CLASH: registered by {by}")
            clashes.append(registry.clash_message(name))
    if clashes:
        lines.append("\nname clashes (a run that selects one of these names fails):")
        lines += [f"  {c}" for c in clashes]
    return "\n".join(lines)
