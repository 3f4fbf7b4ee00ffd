"""The ``fsdp`` planner's pieces in one process: its degrees and errors, the layout it makes without
a process group, the head-tail row split of context parallelism, the context-parallel attention
against the reference kernel, and the row order tensor parallelism gives ``uvqk``.

(The 4-process runs of every layout are in ``test_layouts.py``.)
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from gem_model import testing
from gem_model.api import AttentionExtras, PlannerContext
from gem_model.components import SparseOptimizerSpec
from gem_model.config import ModelConfig
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.distributed import DistEnv
from gem_model.errors import ConfigError
from gem_model.jagged import offsets_of
from gem_model.model.gem import GemModel
from gem_parallel.context_parallel import ContextParallelAttention, head_tail_rows
from gem_parallel.fsdp import FSDPConfig, FSDPPlanner
from gem_parallel.tensor_parallel import _head_major_rows

SPEC = SparseOptimizerSpec(RowWiseAdagrad, {"lr": 0.1})


def offline(world: int) -> DistEnv:
    return DistEnv(0, world, 0, torch.device("cpu"), None)


def planner(**options) -> FSDPPlanner:
    return FSDPPlanner(FSDPConfig(**options))


# ------------------------------------------------------------------------------- degrees, layout


def test_degrees_fill_dp_shard_and_name_the_mesh_dims():
    assert str(planner(dp_replicate=2, tp=2).dims(8)) == "dp_replicate=2 x dp_shard=2 x cp=1 x tp=2 x sparse=1"
    layout = planner(dp_replicate=2, cp=2).layout(offline(8))
    assert layout.degrees == {"dp_replicate": 2, "dp_shard": 2, "cp": 2}
    assert (layout.dp_degree, layout.loss_degree, layout.mesh) == (4, 8, None)
    # replicas only: dp_shard stays in the mesh at degree 1 (FSDP2 replicates over the first of two dims)
    assert planner(dp_replicate=4).layout(offline(4)).degrees == {"dp_replicate": 4, "dp_shard": 1}
    assert planner(tp=4).layout(offline(4)).degrees == {"tp": 4}


@pytest.mark.parametrize(
    ("options", "world", "message"),
    [
        ({"dp_replicate": 3}, 4, r"parallel.planner.options.dp_replicate x cp x tp: must divide the world size 4 .*\(got '3 x 1 x 1'\)"),
        ({"dp_shard": 3}, 4, r"dp_replicate x dp_shard x cp x tp: the mesh degrees multiply to 3, but the world size is 4"),
        ({"tp": 2, "cp": 2}, 4, r"tp = 2 and cp = 2 together are not supported"),
        ({"dp_replicate": 2, "mesh_order": ["dp_shard", "dp_replicate", "cp", "tp"]}, 4, r"mesh_order: dp_replicate must come before dp_shard"),
    ],
)
def test_degrees_that_do_not_fit_name_the_option(options, world, message):
    with pytest.raises(ConfigError, match=message):
        planner(**options).layout(offline(world))


def test_plan_checks_tp_against_the_heads_and_apply_needs_a_mesh():
    src = SyntheticSource(SyntheticConfig(max_len=15))
    model = GemModel(ModelConfig(max_seq_len=16), src.feature_spec(), attention=testing.LoopAttention(), norm_gate=testing.TorchNormGate())
    p = planner(tp=4)
    layout = p.layout(offline(4))
    with pytest.raises(ValueError, match=r"parallel.planner.options.tp = 4 must divide model.num_heads = 2"):
        p.plan(model, PlannerContext(offline(4), layout, testing.PlainComm(), SPEC))
    p = planner()
    layout = p.layout(offline(2))
    plan = p.plan(model, PlannerContext(offline(2), layout, testing.PlainComm(), SPEC))
    assert plan.dense["blocks"].strategy == "fully_sharded" and plan.dense["blocks"].dims == ["dp_shard"]
    with pytest.raises(ValueError, match="needs a process group and its device mesh"):
        p.apply(model, plan, PlannerContext(offline(2), layout, testing.PlainComm(), SPEC))


def test_sharded_tables_are_planned_by_torchrec_offline():
    src = SyntheticSource(SyntheticConfig(max_len=15))
    model = GemModel(ModelConfig(max_seq_len=16), src.feature_spec(), attention=testing.LoopAttention(), norm_gate=testing.TorchNormGate())
    p = planner(tables="sharded", sharding_types=["table_wise"])
    layout = p.layout(offline(4))
    plan = p.plan(model, PlannerContext(offline(4), layout, testing.PlainComm(), SPEC))
    assert {c.name for c in model.table_configs()} == set(plan.tables)
    assert all(t.sharding == "table_wise" and len(t.ranks) == 1 and t.compute_kernel == "fused" for t in plan.tables.values())
    assert plan.native is not None and plan.notes == ["tables sharded by torchrec over all 4 ranks"]
    with pytest.raises(ValueError):
        FSDPConfig(tables="hashed")


# ------------------------------------------------------------------------------ context parallel


def test_head_tail_rows_split_every_sequence_and_balance_causal_work():
    lengths = torch.tensor([0, 1, 5, 8, 13, 64])
    offsets = offsets_of(lengths)
    cp = 4
    parts = [head_tail_rows(offsets, cp, r) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(int(lengths.sum())))
    # rank r holds chunks r and 2cp-1-r of the 64-row sequence: the causal work (its rows' positions + 1) is equal
    start = int(offsets[-2])
    work = [int((p[p >= start] - start + 1).sum()) for p in parts]
    assert work == [520] * cp, work
    assert all(torch.equal(p, torch.sort(p).values) for p in parts)  # sequence order kept


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_context_parallel_attention_matches_the_reference_kernel(one_rank_group):
    """One rank holds every row: the padded attention of the local queries against the gathered
    keys must equal the loop kernel, values and gradients, with targets, window and both biases."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 0, 7, 12])
    offsets = offsets_of(lengths)
    n, h, d, max_len = int(lengths.sum()), 2, 4, 12
    q, k, v = (torch.randn(n, h, d, generator=g, requires_grad=True) for _ in range(3))
    pos_bias = torch.randn(2 * max_len - 1, generator=g, requires_grad=True)
    time_bias = torch.randn(8, generator=g, requires_grad=True)
    times = torch.randint(0, 10_000, (n,), generator=g)
    query_times = times + torch.randint(0, 100, (n,), generator=g)
    extras = AttentionExtras(num_targets=torch.tensor([1, 0, 2, 1]), max_attn_len=4, position_bias=pos_bias,
                             time_bias=time_bias, timestamps=times, query_timestamps=query_times)
    kw = dict(max_seq_len=max_len, alpha=0.5, extras=extras)
    attention = ContextParallelAttention(testing.LoopAttention(), one_rank_group, cp=1, rank=0)
    attention.rows_of = [head_tail_rows(offsets, 1, 0)]
    out = attention(q, k, v, offsets, **kw)
    ref = testing.LoopAttention()(q, k, v, offsets, **kw)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grads = torch.autograd.grad((out * ref.detach().cos()).sum(), (q, k, v, pos_bias, time_bias))
    ref_grads = torch.autograd.grad((ref * ref.detach().cos()).sum(), (q, k, v, pos_bias, time_bias))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------- tensor parallel


def test_uvqk_rows_give_each_tp_rank_its_own_heads():
    h, dv, dqk, tp = 4, 3, 2, 2
    rows = _head_major_rows(h, dv, dqk, tp)
    assert torch.equal(torch.sort(rows).values, torch.arange(h * (2 * dv + 2 * dqk)))
    first = rows[: rows.numel() // tp].tolist()  # rank 0: heads 0 and 1 of u, v, q, k
    u, v, q, k = 0, h * dv, 2 * h * dv, 2 * h * dv + h * dqk
    expect = [*range(u, u + 2 * dv), *range(v, v + 2 * dv), *range(q, q + 2 * dqk), *range(k, k + 2 * dqk)]
    assert first == expect


# ------------------------------------------------------------------------- FSDP2 on one rank


def test_apply_maps_the_precision_policy_onto_fsdp2(one_rank_group):
    """A one-rank mesh: every block and the model are FSDP2 modules, the blocks' outputs come out in
    the activation dtype, the model's loss sums in float32, and the forward is the unwrapped one's."""
    from torch.distributed.fsdp import FSDPModule

    src = SyntheticSource(SyntheticConfig(max_len=15))
    env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")

    def build(dtype: torch.dtype) -> GemModel:
        torch.manual_seed(0)  # the biases' default initialisation
        m = GemModel(ModelConfig(max_seq_len=16), src.feature_spec(), attention=testing.LoopAttention(), norm_gate=testing.TorchNormGate())
        m.set_activation_dtype(dtype)
        return m

    model = build(torch.bfloat16)
    prepared = planner().prepare(model, env=env, comm=testing.PlainComm(), sparse_optimizer=SPEC)
    assert isinstance(prepared.module, FSDPModule)
    for block in model.blocks:
        assert isinstance(block, FSDPModule)
        policy = block._get_fsdp_state()._mp_policy
        assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (None, torch.float32, torch.bfloat16)
    assert model._get_fsdp_state()._mp_policy.output_dtype is None
    assert not any(name.startswith("sparse.") for name, _ in prepared.dense_parameters)

    reference, model = build(torch.float32), build(torch.float32)
    prepared = planner().prepare(model, env=env, comm=testing.PlainComm(), sparse_optimizer=SPEC)
    batch = src.make_batch(0, 4, torch.arange(4))
    out, ref = prepared.module(batch), reference(batch)
    assert out.task_loss_sum.dtype == torch.float32
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
