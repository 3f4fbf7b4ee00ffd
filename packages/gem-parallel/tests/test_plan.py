"""Both planners: a layout before the loader, a plan as plain data, then apply; the plan a run
saves beside its checkpoints is the one ``gem-train plan`` prints without starting processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from gem_model import testing
from gem_model.api import PlannerContext
from gem_model.components import SparseOptimizerSpec
from gem_model.config import ModelConfig
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.distributed import DistEnv
from gem_model.model.gem import GemModel
from gem_model.plan import Plan
from gem_model.protocols import ShardableModel
from gem_parallel.sharded import TorchrecDDPPlanner
from gem_parallel.single import SinglePlanner

SPEC = SparseOptimizerSpec(RowWiseAdagrad, {"lr": 0.1})


def model(**kw) -> GemModel:
    src = SyntheticSource(SyntheticConfig(max_len=15))
    cfg = ModelConfig(max_seq_len=16, **kw)
    return GemModel(cfg, src.feature_spec(), attention=testing.LoopAttention(), norm_gate=testing.TorchNormGate())


def env(world: int = 1) -> DistEnv:
    return DistEnv(0, world, 0, torch.device("cpu"), None)


def test_the_gem_model_meets_planners_through_the_protocol():
    m = model()
    assert isinstance(m, ShardableModel)
    assert set(m.table_modules()) == {"sparse.ec", "sparse.ebc"}
    names = [n for n, _ in m.dense_named_parameters()]
    assert names and not any(n.startswith("sparse.") for n in names)
    assert set(m.table_state_dict()) == {f"{mod}.{k}" for mod, t in m.table_modules().items() for k in t.state_dict()}


def test_single_plans_every_table_unsharded_as_plain_data():
    planner, m = SinglePlanner(), model()
    layout = planner.layout(env())
    plan = planner.plan(m, PlannerContext(env(), layout, testing.PlainComm(), SPEC))
    assert plan.native is None and Plan.from_dict(json.loads(plan.to_json())) == plan
    assert set(plan.tables) == {c.name for c in m.table_configs()}
    assert all(t.sharding == "unsharded" and t.ranks == [0] for t in plan.tables.values())
    assert sum(d.parameters for d in plan.dense.values()) == sum(p.numel() for _, p in m.dense_named_parameters())
    assert "item" in plan.format() and "blocks" in plan.format()
    prepared = planner.apply(m, plan, PlannerContext(env(), layout, testing.PlainComm(), SPEC))
    assert prepared.module is m


def test_torchrec_ddp_plans_offline_for_any_world_size_and_places_every_table():
    planner, m = TorchrecDDPPlanner(), model(table_init="device")
    layout = planner.layout(env(4))
    assert layout.degrees == {"dp_replicate": 4} and layout.group("dp_replicate") is None
    plan = planner.plan(m, PlannerContext(env(4), layout, testing.PlainComm(), SPEC))
    assert set(plan.tables) == {c.name for c in m.table_configs()}
    assert all(t.ranks and max(t.ranks) < 4 and t.compute_kernel == "fused" for t in plan.tables.values())
    assert {d.strategy for d in plan.dense.values()} == {"replicated"}
    with pytest.raises(ValueError, match="needs a process group"):
        planner.apply(m, plan, PlannerContext(env(4), layout, testing.PlainComm(), SPEC))


@pytest.mark.multiprocess
def test_the_plan_beside_a_checkpoint_is_the_one_gem_train_plan_prints(ddp_run):
    # torchrec's planner breaks ties between equally costed sharding types (table_wise and a one-shard
    # column_wise, here) in set order, which follows Python's hash seed: the run had seed 0 too
    env_vars = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    saved = json.loads((ddp_run.out / "checkpoints" / "step_00000003" / "plan.json").read_text())
    printed = subprocess.run(
        [sys.executable, "-m", "gem_model", "plan", "--nproc", "2", "--json", *ddp_run.args], capture_output=True, text=True, env=env_vars
    )
    assert printed.returncode == 0, printed.stderr[-4000:]
    assert json.loads(printed.stdout) == saved
    assert Plan.from_dict(saved).layout == {"degrees": {"dp_replicate": 2}, "world_size": 2}
