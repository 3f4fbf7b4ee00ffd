"""The pieces of 2-D sparse parallelism (``fsdp``'s ``sparse``) that need no 4 processes, and the
layout's one-rank groups. The 4-process run (losses against one process, equal replicas) is in
``test_layouts.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.remote_device import _remote_device
from torchrec.distributed.types import ShardedModule

from gem_model import testing
from gem_model.api import PlannerContext
from gem_model.checks import check_run
from gem_model.config import ModelConfig, TrainerConfig
from gem_model.config_io import load_config
from gem_model.context import Optimizers
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.distributed import DistEnv
from gem_model.errors import ConfigError
from gem_model.model.gem import GemModel
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components
from gem_model.train.optim import sparse_optimizer_spec
from gem_parallel import plugin
from gem_parallel.fsdp import FSDPConfig, FSDPPlanner
from gem_parallel.sharded import TorchrecDDPPlanner
from gem_parallel.sparse_groups import plan_for_group

SGD = sparse_optimizer_spec(TrainerConfig(sparse_optimizer="sgd", sparse_lr=0.5))


def model() -> GemModel:
    src = SyntheticSource(SyntheticConfig(max_len=15))
    return GemModel(
        ModelConfig(max_seq_len=16), src.feature_spec(), attention=testing.LoopAttention(), norm_gate=testing.TorchNormGate()
    )


def offline(world: int) -> DistEnv:
    return DistEnv(0, world, 0, torch.device("cpu"), None)


def test_sparse_must_divide_the_world_before_any_process_starts(tmp_path):
    overrides = [*testing.INLINE_OVERRIDES, "parallel.planner=fsdp", f"trainer.output_dir={tmp_path}"]
    pm = GemPluginManager(autoload=False, plugins=[testing, plugin])
    config = load_config(None, [*overrides, "parallel.planner.options.tables=sharded", "parallel.planner.options.sparse=3"])
    with pytest.raises(ConfigError, match=r"parallel\.planner\.options\.sparse: must divide the world size 4 .*\(got 3\)"):
        check_run(config, resolve_components(config, pm), 4)
    config = load_config(None, [*overrides, "parallel.planner.options.sparse=2"])  # tables replicated
    with pytest.raises(ConfigError, match=r"options\.sparse: shards the tables .* needs parallel\.planner\.options\.tables = sharded \(got 2\)"):
        check_run(config, resolve_components(config, pm), 4)


def test_each_sparse_group_gets_the_group_plan_with_its_own_global_placements():
    planner = FSDPPlanner(FSDPConfig(tables="sharded", sparse=2))
    assert planner.dims(4).sparse == 2 and planner.dims(4).sparse_replicas == 2
    assert FSDPPlanner(FSDPConfig(tables="sharded")).dims(4).sparse == 4  # 0: one group of all ranks
    m, env = model(), offline(4)
    layout = planner.layout(env)
    plan = planner.plan(m, PlannerContext(env, layout, testing.PlainComm(), SGD))
    assert "within each of 2 sparse groups of 2 ranks" in plan.notes[0]
    assert all(t.ranks and max(t.ranks) < 2 for t in plan.tables.values())  # planned for a group of 2
    second = plan_for_group(plan.native, ranks=planner.dims(4).sparse_group_ranks(2))
    for name, shardings in plan.native.plan.items():
        for table, ps in shardings.items():
            moved = second.plan[name][table]
            assert moved.ranks == ps.ranks  # ranks within the group: torchrec's ShardingEnv reads them so
            before = [s.placement.rank() for s in ps.sharding_spec.shards]
            assert [s.placement.rank() for s in moved.sharding_spec.shards] == [r + 2 for r in before]
            assert [s.shard_offsets for s in moved.sharding_spec.shards] == [s.shard_offsets for s in ps.sharding_spec.shards]
            assert {s.placement.device().type for s in moved.sharding_spec.shards} == {"cpu"}
    # on GPUs a placement names the device of the global rank on its node (4 ranks a node here)
    for shardings in plan.native.plan.values():
        for ps in shardings.values():
            for s in ps.sharding_spec.shards:
                s.placement = _remote_device(f"rank:{s.placement.rank()}/cuda:{s.placement.rank()}")
    moved = plan_for_group(plan.native, ranks=[2, 3], local_size=4)
    devices = {str(s.placement) for ps in moved.plan["sparse.ec"].values() for s in ps.sharding_spec.shards}
    assert devices <= {"rank:2/cuda:2", "rank:3/cuda:3"} and devices
    # a strided group (ranks 1 and 3 of 4): group rank i is global rank ranks[i]
    strided = FSDPPlanner(FSDPConfig(tables="sharded", sparse=2, sparse_groups="strided")).dims(4)
    assert strided.sparse_group_ranks(3) == [1, 3]
    moved = plan_for_group(plan.native, ranks=strided.sparse_group_ranks(3), local_size=4)
    devices = {str(s.placement) for ps in moved.plan["sparse.ec"].values() for s in ps.sharding_spec.shards}
    assert devices <= {"rank:1/cuda:1", "rank:3/cuda:3"} and devices


def test_the_optimizers_run_the_planners_after_step_hook_after_each_step():
    seen: list[torch.Tensor] = []
    p = torch.nn.Parameter(torch.ones(2))
    dense = torch.optim.SGD([p], lr=0.1)
    opts = Optimizers(dense, ["p"], None, True, lambda: seen.append(p.detach().clone()))
    p.grad = torch.ones(2)
    opts.step()
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((2,), 0.9))  # it saw the updated weights


def test_a_one_rank_dim_gets_its_real_one_rank_group(tmp_path):
    # torchrec's sharders need a process group even over one rank: the layout hands out the mesh's
    # own group of the degree-1 dim, so torchrec_ddp shards over it (no fallback to the default group)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
        planner = TorchrecDDPPlanner()
        layout = planner.layout(env)
        group = layout.group("dp_replicate")
        assert isinstance(group, dist.ProcessGroup) and group.size() == 1 and group is layout.mesh.get_group()
        assert layout.loss_group is group and layout.group("tp") is None  # tp: not a mesh dim
        spec = sparse_optimizer_spec(TrainerConfig())
        m = model()
        plan = planner.plan(m, PlannerContext(env, layout, testing.PlainComm(), spec))
        prepared = planner.apply(m, plan, PlannerContext(env, layout, testing.PlainComm(), spec))
        sharded = [mod for mod in prepared.module.modules() if isinstance(mod, ShardedModule)]
        assert sharded and all(mod._env.process_group is group for mod in sharded)
    finally:
        dist.destroy_process_group()
