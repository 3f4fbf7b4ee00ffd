"""What the docs say each package registers is what ``gem-train plugins`` shows: the README's package
table, and the core's hints of which package to install for a name (``registry.KNOWN_PROVIDERS``)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from gem_model.plugin_report import plugins_report
from gem_model.plugins import GemPluginManager
from gem_model.registry import KNOWN_PROVIDERS

ROOT = Path(__file__).resolve().parents[1]
OURS = ("gem-model", "gem-kernels", "gem-precision", "gem-parallel", "gem-comm")


@functools.cache
def registered() -> dict[tuple[str, str], str]:
    """(registry, name) -> distribution, read off ``gem-train plugins``' report."""
    out: dict[tuple[str, str], str] = {}
    registry = None
    for line in plugins_report(GemPluginManager()).splitlines():
        if re.fullmatch(r"[a-z_.]+:", line):
            registry = line[:-1]
        elif registry and (m := re.fullmatch(r"  (\S+) +from (\S+) \S+", line)):
            out[(registry, m.group(1))] = m.group(2)
    return out


def readme_rows() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    table = text[text.index("| package | adds |") :].split("\n\n")[0]
    return {m.group(1): row for row in table.splitlines() if (m := re.match(r"\| `([a-z-]+)` \|", row))}


def test_the_report_is_read():
    found = registered()
    assert ("parallel.planner", "fsdp") in found and ("kernels.jagged_attention", "triton") in found


@pytest.mark.parametrize("dist", OURS)
def test_the_readme_table_lists_every_name_a_package_registers(dist):
    row = readme_rows()[dist]
    missing = sorted(f"{reg} {name}" for (reg, name), d in registered().items() if d == dist and f"`{name}`" not in row)
    assert missing == [], f"README.md's row of {dist} does not name them"


def test_the_install_hints_are_what_the_packages_register():
    pm = GemPluginManager()
    kinds = {r.config_path: r.kind for r in [*(pm.registries[a] for a in pm.registries if a != "kernels"),
                                             *pm.registries["kernels"].values()]}  # fmt: skip
    plugins = {(kinds[reg], name): d for (reg, name), d in registered().items() if d in OURS and d != "gem-model"}
    assert KNOWN_PROVIDERS == plugins
