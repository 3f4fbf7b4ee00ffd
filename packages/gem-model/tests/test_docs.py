"""docs/plugins.md covers every hook, interface method, run-context field and registered kind (datasette's pattern)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from gem_model import api, components, hookspecs, kernels, lifecycle, protocols, saved_format
from gem_model.context import RunContext
from gem_model.layout import Layout
from gem_model.plugins import REGISTRY_SPECS

DOC = (Path(__file__).resolve().parents[3] / "docs" / "plugins.md").read_text()
HOOKS = [n for n, f in vars(hookspecs).items() if n.startswith("gem_") and inspect.isfunction(f)]
INTERFACES = [
    c for m in (components, kernels, lifecycle) for c in vars(m).values()
    if inspect.isclass(c) and issubclass(c, components.Component) and c.__module__ == m.__name__ and c is not components.Component
]  # fmt: skip
PROTOCOLS = [protocols.ShardableModel, protocols.Stateful, saved_format.SavedFormatBlock]


def public_members(cls: type) -> list[str]:
    names = []
    for name, value in vars(cls).items():
        if (name.startswith("_") and name != "__call__") or not (callable(value) or isinstance(value, property)):
            continue
        if name in ("Config", "name"):
            continue
        names.append(name)
    return names


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented(hook):
    assert f"`{hook}" in DOC


@pytest.mark.parametrize("cls", INTERFACES + PROTOCOLS, ids=lambda c: c.__name__)
def test_every_interface_method_is_documented(cls):
    assert f"`{cls.__name__}`" in DOC
    missing = [f"{cls.__name__}.{m}" for m in public_members(cls) if f"{cls.__name__}.{m}" not in DOC]
    assert missing == []


def test_every_run_context_field_and_layout_member_is_documented():
    fields = [f.name for f in dataclasses.fields(RunContext) if not f.name.startswith("_")] + ["is_main"]
    assert [f for f in fields if f"RunContext.{f}" not in DOC] == []
    members = [f.name for f in dataclasses.fields(Layout)] + public_members(Layout)
    assert [m for m in members if f"Layout.{m}" not in DOC] == []


@pytest.mark.parametrize("attr", sorted(REGISTRY_SPECS))
def test_every_registered_kind_is_documented(attr):
    spec = REGISTRY_SPECS[attr]
    assert spec.hook in DOC and f"`{spec.config_path}`" in DOC and spec.kind in DOC and f"`{spec.base.__name__}`" in DOC


def test_every_kernel_op_is_documented():
    ops = [c.op for c in INTERFACES if issubclass(c, components.Kernel) and "op" in vars(c)]
    assert ops and [op for op in ops if f"`kernels.{op}`" not in DOC] == []


def test_every_name_of_the_public_module_is_documented():
    assert [n for n in api.__all__ if f"`{n}" not in DOC and n != "hookimpl"] == []


def test_the_check_can_fail():
    class Extra(components.CommStrategy):
        def brand_new_method(self):
            """An undocumented method."""

    assert "brand_new_method" in public_members(Extra)
    assert "CommStrategy.brand_new_method" not in DOC
