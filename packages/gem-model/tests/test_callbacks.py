"""Lifecycle plugins by config, the run context hooks get, stateful components, plans beside checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from importlib import metadata

import pytest
import torch

from gem_model import hookimpl, testing
from gem_model.cli import main
from gem_model.config_io import load_config
from gem_model.context import RunContext
from gem_model.errors import ConfigError, DuplicateNameError, PluginError, UnknownNameError
from gem_model.layout import Layout
from gem_model.plan import Plan
from gem_model.plugins import GemPluginManager
from gem_model.train.checkpoint import latest_checkpoint
from gem_model.trainer import train


@pytest.fixture(autouse=True)
def _fresh():
    testing.Recorder.runs.clear()


def test_an_installed_callback_no_config_names_does_nothing(pm, tiny_overrides):
    assert "inline_recorder" in pm.callbacks.names()
    train(load_config(None, [*tiny_overrides, "trainer.steps=2"]), pm)
    assert testing.Recorder.runs == []


def test_a_named_callback_sees_the_run_with_its_options(pm, tiny_overrides, capsys):
    cfg = load_config(None, [*tiny_overrides, "trainer.steps=2", "callbacks=[{name: inline_recorder, options: {label: mine}}]"])
    train(cfg, pm)
    (rec,) = testing.Recorder.runs
    assert rec.config.label == "mine"
    assert rec.events == ["started 0", "step 0", "step 1", "finished 2"]
    assert "== mine" in capsys.readouterr().out
    assert all(name != "callback:inline_recorder" for name, _ in pm.pm.list_name_plugin())  # for that run only


def test_callback_options_and_names_are_checked(pm, tiny_overrides):
    with pytest.raises(ConfigError, match=r"callbacks.0.options"):
        train(load_config(None, [*tiny_overrides, "callbacks=[{name: inline_recorder, options: {colour: 1}}]"]), pm)
    with pytest.raises(UnknownNameError, match=r"callbacks.0: unknown callback 'tracer'"):
        train(load_config(None, [*tiny_overrides, "callbacks=[tracer]"]), pm)
    with pytest.raises(ConfigError, match=r"listed more than once"):
        load_config(None, [*tiny_overrides, "callbacks=[inline_recorder, inline_recorder]"])


def test_hooks_get_the_run_context(pm, tiny_overrides, tmp_path):
    seen: list[RunContext] = []

    class Probe:
        @hookimpl
        def gem_run_started(self, run):
            seen.append(run)

        @hookimpl(wrapper=True)
        def gem_train_step(self, run, step):
            assert run.step == step
            return (yield)

    pm.register(Probe(), name="probe")
    train(load_config(None, [*tiny_overrides, "trainer.steps=2"]), pm)
    (ctx,) = seen
    assert isinstance(ctx, RunContext) and isinstance(ctx.layout, Layout) and isinstance(ctx.plan, Plan)
    assert ctx.config.trainer.steps == 2 and ctx.output_dir == tmp_path / "gem-tiny" and ctx.is_main
    assert isinstance(ctx.optimizers.dense, torch.optim.AdamW) and ctx.comm.name == "inline_comm"
    assert ctx.step == 2 and isinstance(ctx.model, torch.nn.Module)


def test_a_stateful_component_is_checkpointed_under_its_registry_and_name(pm, tiny_overrides, tmp_path):
    common = [*tiny_overrides, "callbacks=[inline_recorder]", f"trainer.output_dir={tmp_path}/run"]
    train(load_config(None, [*common, "trainer.steps=3"]), pm)
    ckpt = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert ckpt is not None
    assert '"components.callbacks.inline_recorder.steps_seen"' in _dcp_keys(ckpt)
    train(load_config(None, [*common, "trainer.steps=5"]), pm)
    resumed = testing.Recorder.runs[-1]
    assert resumed.events[0] == "started 3" and int(resumed.steps_seen) == 5  # 3 restored + 2 new


def _dcp_keys(path) -> str:
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(path)).read_metadata()
    return json.dumps(sorted(meta.state_dict_metadata))


def test_the_plan_is_saved_beside_each_checkpoint(pm, tiny_overrides, tmp_path):
    train(load_config(None, [*tiny_overrides, "trainer.steps=4", "trainer.checkpoint_every=2"]), pm)
    root = tmp_path / "gem-tiny" / "checkpoints"
    for step in ("step_00000002", "step_00000004"):
        plan = Plan.from_dict(json.loads((root / step / "plan.json").read_text()))
        assert plan.planner == "inline_single" and plan.layout["world_size"] == 1
        assert plan.tables["item"].sharding == "unsharded" and plan.tables["item"].rows > 0
    meta = json.loads((root / "step_00000004" / "meta.json").read_text())
    assert meta["layout"] == {"degrees": {"dp_replicate": 1}, "world_size": 1}


def test_a_clash_fails_only_the_run_that_selects_it(pm, tiny_overrides, capsys, monkeypatch):
    clash = types.ModuleType("clash")
    clash.gem_register_comm_strategies = hookimpl(lambda: [testing.PlainComm])
    pm.register(clash, name="clash", distribution=("gem-clash", "0.1"))
    with pytest.raises(DuplicateNameError, match=r"comm.strategy: comm strategy 'inline_comm' is registered twice"):
        train(load_config(None, [*tiny_overrides, "trainer.steps=1"]), pm)
    pm.precision_schemes.get("inline_fp32")  # every other name still resolves


def test_plugins_command_shows_hooks_and_clashes(capsys, monkeypatch):
    clash = types.ModuleType("gem_clash_plugin")
    clash.gem_register_comm_strategies = hookimpl(lambda: [testing.PlainComm])
    monkeypatch.setitem(sys.modules, "gem_clash_plugin", clash)
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing,gem_clash_plugin")
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "plugin gem_model.testing: gem_register_activation_policies, gem_register_callbacks" in out
    assert "plugin model: gem_register_data_sources" in out and "gem_train_step" in out
    assert "inline_comm" in out and "CLASH: registered by" in out and "is registered twice" in out


def test_an_installed_module_implementing_a_lifecycle_hook_is_refused(monkeypatch):
    module = types.ModuleType("gem_eager_plugin")
    module.gem_run_started = hookimpl(lambda run: None)
    monkeypatch.setitem(sys.modules, "gem_eager_plugin", module)
    ep = metadata.EntryPoint(name="eager", value="gem_eager_plugin", group="gem")
    real = metadata.entry_points
    monkeypatch.setattr(metadata, "entry_points", lambda **kw: [ep] if kw.get("group") == "gem" else real(**kw))
    with pytest.raises(PluginError, match=r"'eager'.*gem_run_started at module level.*Callback"):
        GemPluginManager(autoload=True)
    monkeypatch.setenv("GEM_PLUGINS", "gem_eager_plugin")
    with pytest.raises(PluginError, match=r"GEM_PLUGINS implements the lifecycle hook"):
        GemPluginManager(autoload=False)


def test_plan_command_prints_the_plan_without_training(tmp_path):
    env = {"GEM_PLUGINS": "gem_model.testing", "GEM_DISABLE_PLUGIN_AUTOLOAD": "1", "PATH": "/usr/bin:/bin"}
    args = [*testing.INLINE_OVERRIDES, f"trainer.output_dir={tmp_path}/x"]
    proc = subprocess.run([sys.executable, "-m", "gem_model", "plan", *args, "--json"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    plan = Plan.from_dict(json.loads(proc.stdout))
    assert plan.planner == "inline_single" and set(plan.tables) >= {"item", "action"}
    assert not (tmp_path / "x").exists()
    proc = subprocess.run([sys.executable, "-m", "gem_model", "plan", *args, "--nproc", "2"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "--nproc" in proc.stderr
