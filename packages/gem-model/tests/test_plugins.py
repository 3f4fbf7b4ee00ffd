"""The plugin manager: loading, registries and every error named in the architecture."""

from __future__ import annotations

import types
from importlib import metadata
from typing import ClassVar

import pytest

from gem_model import hookimpl, testing
from gem_model.components import PrecisionScheme
from gem_model.errors import DuplicateNameError, PluginError, UnknownNameError
from gem_model.plugins import GemPluginManager


class Scheme(PrecisionScheme):
    name: ClassVar[str] = "inline_fp32"

    def convert_linear(self, linear, fqn):
        return linear


def plugin_module(name: str, **hooks) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook, fn in hooks.items():
        setattr(module, hook, hookimpl(fn))
    return module


def test_builtins_register_through_the_same_hooks():
    pm = GemPluginManager(autoload=False)
    assert pm.data_sources.names() == ["movielens_1m", "parquet", "synthetic"]
    assert pm.load_balancers.names() == ["round_robin"]
    assert pm.data_sources.get("synthetic").provider.distribution == "gem-model"
    assert pm.kernel_registry("next_item_loss").names() == ["torch"]  # the default of kernels.next_item_loss
    assert pm.kernel_registry("next_item_loss").get("torch").provider.distribution == "gem-model"


def test_inline_plugin_fills_every_registry(pm):
    assert pm.kernel_registry("jagged_attention").names() == ["loop", "poison"]
    assert pm.kernel_registry("norm_gate").names() == ["loop"]
    assert pm.precision_schemes.names() == ["inline_bf16", "inline_fp32"]
    assert pm.activation_policies.names() == ["inline_none"]
    assert pm.comm_strategies.names() == ["inline_comm"]
    assert pm.parallel_planners.names() == ["inline_replicated", "inline_single"]


def test_duplicate_name_fails_only_when_selected_and_names_both_distributions(pm):
    pm.register(plugin_module("other", gem_register_precision_schemes=lambda: [Scheme]), distribution=("gem-other", "9.9"))
    registry = pm.precision_schemes  # building the registries does not fail
    assert "inline_fp32" not in registry.names() and "inline_bf16" in registry.names()
    assert [p.distribution for p in registry.clashes()["inline_fp32"]] == ["<inline>", "gem-other"]
    registry.get("inline_bf16")  # the other names still resolve
    with pytest.raises(DuplicateNameError) as err:
        registry.get("inline_fp32")
    msg = str(err.value)
    assert "precision.scheme" in msg and "'inline_fp32'" in msg and "<inline>" in msg and "gem-other 9.9" in msg


def test_unknown_name_lists_available_names_and_providers(pm):
    with pytest.raises(UnknownNameError) as err:
        pm.precision_schemes.get("fp4")
    msg = str(err.value)
    assert "precision.scheme" in msg and "'fp4'" in msg
    assert "inline_fp32: from <inline>" in msg and "inline_bf16: from <inline>" in msg


def test_unknown_name_says_which_package_provides_it():
    pm = GemPluginManager(autoload=False)
    with pytest.raises(UnknownNameError, match="provided by gem-precision, which is not installed"):
        pm.precision_schemes.get("mxfp8")


def test_plugin_raising_in_a_registration_hook_is_named_and_chained(pm):
    def boom():
        raise RuntimeError("cannot build table")

    pm.register(plugin_module("bad", gem_register_comm_strategies=boom), name="bad", distribution=("gem-bad", "0.3"))
    with pytest.raises(PluginError) as err:
        pm.comm_strategies
    msg = str(err.value)
    assert "'bad'" in msg and "gem-bad 0.3" in msg and "gem_register_comm_strategies" in msg
    assert isinstance(err.value.__cause__, RuntimeError)


def test_plugin_raising_in_a_lifecycle_hook_is_named_and_chained(pm):
    def started(run):
        raise KeyError("missing")

    pm.register(plugin_module("late", gem_run_started=started), name="late", distribution=("gem-late", "1.0"))
    with pytest.raises(PluginError) as err:
        pm.call("gem_run_started", run=object())
    assert "'late'" in str(err.value) and "gem-late 1.0" in str(err.value) and "gem_run_started" in str(err.value)
    assert isinstance(err.value.__cause__, KeyError)


def test_registration_must_return_component_classes(pm):
    pm.register(plugin_module("wrong", gem_register_parallel_planners=lambda: [object]), name="wrong")
    with pytest.raises(PluginError, match="expected a subclass of gem_model.components.ParallelPlanner"):
        pm.parallel_planners


def test_bad_component_name_is_rejected(pm):
    class Upper(Scheme):
        name = "FP-32"

    pm.register(plugin_module("upper", gem_register_precision_schemes=lambda: [Upper]), name="upper")
    with pytest.raises(TypeError, match="lowercase snake_case"):
        pm.precision_schemes


def test_misspelt_hook_fails_check_pending(pm):
    module = plugin_module("typo", gem_register_kernel=lambda: [])
    with pytest.raises(Exception, match="unknown hook 'gem_register_kernel'"):
        pm.register(module, name="typo")


def _fake_entry_point(monkeypatch, module_name: str, module: types.ModuleType) -> None:
    import sys

    monkeypatch.setitem(sys.modules, module_name, module)
    ep = metadata.EntryPoint(name="fake", value=module_name, group="gem")
    real = metadata.entry_points

    def entry_points(**kw):
        return [ep] if kw.get("group") == "gem" else real(**kw)

    monkeypatch.setattr(metadata, "entry_points", entry_points)


def test_autoload_reads_entry_points_unless_disabled(monkeypatch):
    module = plugin_module("gem_fake_plugin", gem_register_parallel_planners=lambda: [testing.Single])
    _fake_entry_point(monkeypatch, "gem_fake_plugin", module)
    monkeypatch.setenv("GEM_DISABLE_PLUGIN_AUTOLOAD", "")
    assert GemPluginManager().parallel_planners.names() == ["inline_single"]
    monkeypatch.setenv("GEM_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert GemPluginManager().parallel_planners.names() == []


def test_entry_point_that_fails_to_import_is_named(monkeypatch):
    ep = metadata.EntryPoint(name="broken", value="gem_no_such_module_xyz", group="gem")
    real = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points", lambda **kw: [ep] if kw.get("group") == "gem" else real(**kw))
    with pytest.raises(PluginError, match="'broken'.*failed to import"):
        GemPluginManager(autoload=True)


def test_gem_plugins_env_registers_modules_by_import_path(monkeypatch):
    import sys

    module = plugin_module("gem_env_plugin", gem_register_comm_strategies=lambda: [testing.PlainComm])
    monkeypatch.setitem(sys.modules, "gem_env_plugin", module)
    monkeypatch.setenv("GEM_PLUGINS", "gem_env_plugin")
    pm = GemPluginManager(autoload=False)
    assert pm.comm_strategies.names() == ["inline_comm"]
    monkeypatch.setenv("GEM_PLUGINS", "gem_env_plugin_missing")
    with pytest.raises(PluginError, match="GEM_PLUGINS failed to import"):
        GemPluginManager(autoload=False)


REGISTRATION_HOOKS = {
    "gem_register_kernels": ("kernels", testing.LoopAttention),
    "gem_register_precision_schemes": ("precision_schemes", testing.Fp32),
    "gem_register_activation_policies": ("activation_policies", testing.NoPolicy),
    "gem_register_comm_strategies": ("comm_strategies", testing.PlainComm),
    "gem_register_parallel_planners": ("parallel_planners", testing.Single),
    "gem_register_data_sources": ("data_sources", None),
    "gem_register_load_balancers": ("load_balancers", None),
    "gem_register_train_pipelines": ("train_pipelines", None),
    "gem_register_callbacks": ("callbacks", testing.Recorder),
}


@pytest.mark.parametrize("hook", sorted(REGISTRATION_HOOKS))
def test_each_registration_hook_fills_its_registry(hook):
    from gem_model.data.balance import RoundRobinBalancer
    from gem_model.data.synthetic import SyntheticSource
    from gem_model.train.pipeline import SequentialPipeline

    attr, cls = REGISTRATION_HOOKS[hook]
    if cls is None:  # gem-model's built-ins answer these hooks; register a renamed copy beside them
        base = {"data_sources": SyntheticSource, "load_balancers": RoundRobinBalancer}.get(attr, SequentialPipeline)
        cls = type("Renamed", (base,), {"name": "renamed"})
    pm = GemPluginManager(autoload=False)
    pm.register(plugin_module("one", **{hook: lambda: [cls]}), name="one", distribution=("gem-one", "1"))
    registry = pm.kernel_registry(cls.op) if attr == "kernels" else getattr(pm, attr)
    assert registry.get(cls.name).provider.distribution == "gem-one"
