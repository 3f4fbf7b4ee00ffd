"""``auto``: the topology planner as a registered planner of real runs, and its prediction.

It chooses degrees for the run it is bound to that the core's checks accept and ``fsdp`` applies;
with a one-GPU ``gem-train profile`` of the same run (a real one, made once here on the CPU) it
predicts the step, whose one-GPU value is the profile's measured step, and the scaling efficiency.
The 4-process runs of ``fsdp`` layouts are ``test_layouts.py``'s.
"""

from __future__ import annotations

import json

import pytest
import torch

import gem_parallel.plugin
from gem_model import testing
from gem_model.api import (
    ConfigError,
    DistEnv,
    GemModel,
    GemPluginManager,
    PlannerContext,
    load_config,
    resolve_components,
    run_shape,
)
from gem_model.cli import main
from gem_model.train.optim import sparse_optimizer_spec
from gem_parallel.auto import AutoConfig, AutoPlanner
from gem_parallel.fsdp import hsdp_order

RUN = [*testing.INLINE_OVERRIDES, "trainer.progress=false", "model.num_heads=4", "parallel.planner=auto"]


def bound(world_per_node: int, *overrides: str) -> tuple[AutoPlanner, object, object]:
    config = load_config(None, [*RUN, *overrides])
    components = resolve_components(config, GemPluginManager(autoload=False, plugins=[testing, gem_parallel.plugin]))
    planner = components.planner
    assert isinstance(planner, AutoPlanner)
    planner.bind_run(run_shape(config, components, ranks_per_node=world_per_node))
    return planner, config, components


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    """A one-process ``gem-train profile`` of the tiny run (step time and MFU sections)."""
    out = tmp_path_factory.mktemp("profile")
    config = [o for o in RUN if o != "parallel.planner=auto"] + ["parallel.planner=inline_single"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GEM_PLUGINS", "gem_model.testing")
        code = main(["profile", *config, f"trainer.output_dir={out}", "--out", str(out), "--sections", "step_time,mfu",
                     "--warmup", "1", "--steps", "2", "--batches", "1"])  # fmt: skip
    assert code == 0
    return out


def test_auto_chooses_degrees_the_checks_accept_and_fsdp_applies():
    planner, config, _ = bound(4)
    dims = planner.dims(4)
    dims.check(world_size=4, num_heads=4, global_batch_size=config.data.global_batch_size, max_seq_len=16)
    assert hsdp_order(dims) and not (dims.tp > 1 and dims.cp > 1) and 4 % dims.sparse == 0
    layout = planner.layout(DistEnv(0, 4, 0, torch.device("cpu"), None))
    assert layout.dims == dims and layout.world_size == 4
    assert planner.choose(4) is planner.choose(4)  # searched once per world size


def test_without_a_profile_the_plan_says_there_is_no_prediction():
    planner, config, components = bound(2)
    env = DistEnv(0, 2, 0, torch.device("cpu"), None)
    model = GemModel(config.model, components.source.feature_spec(), attention=components.attention,
                     norm_gate=components.norm_gate, next_item_loss=components.next_item_loss)  # fmt: skip
    ctx = PlannerContext(env, planner.layout(env), components.comm, sparse_optimizer_spec(config.trainer))
    plan = planner.plan(model, ctx)
    assert plan.planner == "auto" and plan.prediction["communication_seconds"] >= 0
    assert "step_seconds" not in plan.prediction
    assert any("no step-time prediction: set parallel.planner.options.profile" in n for n in plan.notes)
    assert plan.notes[0].startswith("chosen for 1x2 GPUs: ")


def test_the_one_gpu_prediction_is_the_profiled_step_and_more_gpus_scale_below_one(profile):
    summary = {s["name"]: s["summary"] for s in json.loads((profile / "profile.json").read_text())["sections"]}
    measured = sum(summary["step_time"]["step_seconds"]) / summary["step_time"]["steps"]
    planner, _, _ = bound(1, f"parallel.planner.options.profile={profile}")
    one = planner.choose(1).prediction
    assert one is not None and one.world_size == 1 and one.communication == 0.0
    assert one.step_seconds == pytest.approx(measured, rel=1e-9)  # compute + idle = the measured wall time
    assert one.scaling_efficiency == pytest.approx(1.0)
    planner, _, _ = bound(2, f"parallel.planner.options.profile={profile}")
    two = planner.choose(2).prediction
    assert two.one_gpu_step_seconds == pytest.approx(one.step_seconds)
    assert two.step_seconds == pytest.approx(two.dense_compute + two.embeddings + two.idle + two.communication)
    assert 0 < two.scaling_efficiency < 1  # the idle time per step does not shrink with the batch


def test_gem_train_plan_prints_the_layout_the_step_and_the_efficiency(profile, capsys, monkeypatch):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing,gem_parallel.plugin")
    assert main(["plan", *RUN, f"parallel.planner.options.profile={profile}", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("planner auto: ") and "predicted step " in out and "scaling efficiency " in out, out


def test_a_profile_of_another_run_is_refused_naming_the_fields(profile):
    planner, _, _ = bound(1, f"parallel.planner.options.profile={profile}", "model.num_blocks=2")
    with pytest.raises(ConfigError, match=r"options\.profile: is a profile of another run: model\.num_blocks \(1 -> 2\)"):
        planner.dims(1)


def test_options_that_cannot_plan_are_named():
    planner, _, _ = bound(0)
    with pytest.raises(ConfigError, match=r"options\.gpus_per_node: nobody said how many GPUs a node has"):
        planner.dims(2)
    planner = AutoPlanner(AutoConfig(gpus_per_node=3))
    planner.bind_run(bound(0)[0]._run)
    with pytest.raises(ConfigError, match=r"options\.gpus_per_node: must divide the world size 4"):
        planner.dims(4)


def test_one_rank_needs_no_node_size_and_plans_as_torchrec_ddp():
    """One process, not launched by torchrun (no ranks per node known): one GPU is the whole node, and
    the plan is torchrec_ddp's (the same layout; torchrec's fused table update instead of FSDP2 hooks
    with nothing to shard), under the name ``auto``; auto asks for a process group, so a plain
    ``gem-train run`` starts one instead of failing in fsdp's apply."""
    assert AutoPlanner.needs_process_group
    planner, config, components = bound(0)
    env = DistEnv(0, 1, 0, torch.device("cpu"), None)
    layout = planner.layout(env)
    assert layout.world_size == 1 and layout.mesh_dims == ("dp_replicate",)
    model = GemModel(config.model, components.source.feature_spec(), attention=components.attention,
                     norm_gate=components.norm_gate, next_item_loss=components.next_item_loss)  # fmt: skip
    plan = planner.plan(model, PlannerContext(env, layout, components.comm, sparse_optimizer_spec(config.trainer)))
    assert plan.planner == "auto" and plan.notes[0].startswith("chosen for 1x1 GPUs: ")
    assert {p.strategy for p in plan.dense.values()} == {"replicated"}
    assert all(t.ranks == [0] for t in plan.tables.values()) and plan.native is not None
