"""A plugin that raises in any lifecycle hook of a run, or fails to import, is named with its
distribution and hook; the checkpoints written before stay valid, and the run resumes from them."""

from __future__ import annotations

import types
from importlib import metadata
from typing import ClassVar

import pytest

from gem_model import testing
from gem_model.api import hookimpl
from gem_model.config_io import load_config
from gem_model.errors import PluginError
from gem_model.lifecycle import Callback
from gem_model.plugins import GemPluginManager
from gem_model.train import integrity
from gem_model.trainer import train

LIFECYCLE = ("gem_run_started", "gem_train_step", "gem_run_finished", "gem_report_sections")
FAIL_AT = 3  # gem_train_step raises after step 3's update; checkpoints every 2 steps


def flaky_plugin(hook: str) -> types.ModuleType:
    """A distribution whose callback ``flaky`` raises in ``hook``."""

    class Flaky(Callback):
        name: ClassVar[str] = "flaky"

    def raising(self, **kwargs):
        raise RuntimeError(f"flaky broke in {hook}")

    if hook == "gem_train_step":

        def step_then_raise(self, run, step):
            result = yield
            if step + 1 == FAIL_AT:
                raise RuntimeError(f"flaky broke in {hook}")
            return result

        Flaky.gem_train_step = hookimpl(wrapper=True)(step_then_raise)
    else:
        setattr(Flaky, hook, hookimpl(lambda self, run, summary=None: raising(self)))
    module = types.ModuleType("gem_flaky")
    module.gem_register_callbacks = hookimpl(lambda: [Flaky])
    return module


def checkpoints(root):
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


@pytest.mark.parametrize("hook", LIFECYCLE)
def test_a_plugin_raising_in_any_hook_is_named_and_the_checkpoints_stay_valid(pm, tiny_overrides, tmp_path, hook):
    pm.register(flaky_plugin(hook), name="gem_flaky", distribution=("gem-flaky", "0.1"))
    common = [*tiny_overrides, "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.eval_at_end=false"]
    with pytest.raises(PluginError) as info:
        train(load_config(None, [*common, "callbacks=[flaky]"]), pm)
    message = str(info.value)
    assert "from distribution gem-flaky 0.1" in message and f"raised in hook {hook}" in message, message
    assert f"RuntimeError: flaky broke in {hook}" in message
    root = tmp_path / "gem-tiny" / "checkpoints"
    written = {"gem_run_started": [], "gem_train_step": ["step_00000002"]}.get(hook, ["step_00000002", "step_00000004"])
    assert checkpoints(root) == written  # no .partial left, none newer than the failure
    assert all(integrity.verify(root / name) == [] for name in written)
    if hook == "gem_train_step":  # the same run without the broken plugin continues from the valid one
        summary = train(load_config(None, common), GemPluginManager(autoload=False, plugins=[testing]))
        assert summary.steps == 4 and checkpoints(root) == ["step_00000002", "step_00000004"]


def test_a_plugin_failing_to_import_is_named_with_its_distribution(monkeypatch):
    ep = metadata.EntryPoint(name="gem_broken", value="gem_no_such_module_xyz", group="gem")
    real = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points", lambda **kw: [ep] if kw.get("group") == "gem" else real(**kw))
    with pytest.raises(PluginError, match=r"plugin 'gem_broken' of distribution .* failed to import \(gem_no_such_module_xyz\)"):
        GemPluginManager(autoload=True)


def test_a_gem_plugins_module_failing_to_import_is_named_with_its_distribution(monkeypatch):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.no_such_plugin_module")
    # an editable install maps no distribution to its top-level name: then that name stands for it
    with pytest.raises(PluginError, match=r"plugin module 'gem_model.no_such_plugin_module' of distribution "
                       r"(gem-model|gem_model \(GEM_PLUGINS\)) named in GEM_PLUGINS failed to import"):  # fmt: skip
        GemPluginManager(autoload=False)
