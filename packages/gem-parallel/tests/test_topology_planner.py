"""The topology-aware planner on simulated H200 clusters: 1x8, 16x8, 128x8 and 512x8 GPUs.

torchrec's ``EmbeddingShardingPlanner`` runs for real (on the meta device, no process group). The
GEM-sized model has 1.1B dense and 1.13T table parameters; the tests give it 4 pooled tables
instead of 24 (0.6T) where the point is the layout, to keep torchrec's part short.
"""

from __future__ import annotations

import json

import pytest

from gem_model.api import MESH_DIMS
from gem_parallel.cost import Lookups, estimate
from gem_parallel.sparse_plan import PlanDoesNotFitError, _check_and_count, plan_sparse_group, sparse_topology
from gem_parallel.topology import h200
from gem_parallel.topology_planner import NAIVE_ORDER, PlannerOptions, candidate_dims, orders, plan_topology
from gem_parallel.workload import LengthProfile, TableSpec, Workload, gem_sized


def small(global_batch_size: int = 256, **kw) -> Workload:
    """100M dense parameters, 25B table parameters: fits one node."""
    base = {
        "num_layers": 8,
        "dense_params_per_layer": 12_000_000,
        "other_dense_params": 4_000_000,
        "embedding_dim": 512,
        "num_heads": 8,
        "attention_dim": 64,
        "value_dim": 64,
        "tables": (
            TableSpec(name="item", num_rows=50_000_000, dim=256, kind="sequence"),
            TableSpec(name="user", num_rows=100_000_000, dim=128),
            TableSpec(name="city", num_rows=10_000, dim=64),
        ),
        "lengths": LengthProfile.zipf(1.2, 1024),
        "global_batch_size": global_batch_size,
    }
    return Workload(**(base | kw))


def check_plan(plan, w: Workload) -> None:
    topo = plan.topology
    dims = plan.dims
    assert dims.world_size == topo.world_size and topo.world_size % dims.sparse == 0
    dims.check(world_size=topo.world_size, num_heads=w.num_heads, global_batch_size=w.global_batch_size,
               max_seq_len=w.lengths.max)
    assert set(plan.sparse.sharding_types) == {t.name for t in w.tables}  # every table placed
    assert plan.sparse.topology.world_size == dims.sparse
    assert plan.cost.memory.total <= topo.usable_hbm
    assert plan.cost.memory.tables == plan.sparse.max_table_bytes
    assert plan.cost.comm_seconds <= plan.naive.comm_seconds
    # the cheapest order of the chosen degrees is the one chosen
    tables = plan.sparse.max_table_bytes
    for other_order in orders(dims):
        other = estimate(other_order, topo, w, table_bytes_per_rank=tables)
        assert plan.cost.comm_seconds <= other.comm_seconds + 1e-12
    if dims.tp > 1:
        assert plan.links()["tp"] == "nvlink"
    assert list(plan.mesh_degrees()) == list(plan.dims.mesh_order)
    json.dumps(plan.to_dict())  # plain data
    assert str(plan.dims) in plan.summary()


def test_one_node_plans_a_model_that_fits():
    w = small()
    plan = plan_topology(h200(1), w)
    check_plan(plan, w)
    assert all(p.link in ("nvlink", "none") for p in plan.cost.placements.values())
    assert plan.links()["sparse"] in ("nvlink", "none")


def test_one_node_cannot_hold_a_trillion_parameters_and_says_by_how_much():
    with pytest.raises(PlanDoesNotFitError) as info:
        plan_topology(h200(1), gem_sized(global_batch_size=256))
    msg = str(info.value)
    assert "does not fit on 1x8 GPUs" in msg
    assert "largest item is table 'item' (2056.0 GB" in msg and "shortfall of 439.7 GB per GPU" in msg


def test_a_dense_part_too_big_for_any_layout_names_its_largest_item():
    w = small(num_layers=4, dense_params_per_layer=40_000_000_000)  # 160B dense parameters
    with pytest.raises(PlanDoesNotFitError, match=r"the leanest layout \(.*\) needs .* shortfall .* largest item is dense_states"):
        plan_topology(h200(1), w)


@pytest.mark.parametrize("nodes", [16, 128, 512])
def test_gem_sized_model_on_many_nodes(nodes):
    w = gem_sized(global_batch_size=32 * nodes * 8, pooled_tables=4)
    plan = plan_topology(h200(nodes), w)
    check_plan(plan, w)
    assert plan.dims.sparse > 1  # 2.4 TB of tables cannot sit on one GPU
    assert plan.cost.comm_seconds < plan.naive.comm_seconds


def test_fixed_degrees_are_kept():
    w = small()
    plan = plan_topology(h200(2), w, PlannerOptions(fixed={"tp": 1, "sparse": 4}))
    assert plan.dims.tp == 1 and plan.dims.sparse == 4
    assert all(d.tp == 1 and d.sparse == 4 for d in candidate_dims(h200(2), w, PlannerOptions(fixed={"tp": 1, "sparse": 4})))


def test_candidates_respect_heads_sequence_length_and_batch():
    w = small(num_heads=4, global_batch_size=8, lengths=LengthProfile(mean=10, mean_square=150, max=12))
    seen = list(candidate_dims(h200(2), w, PlannerOptions()))
    assert seen
    for d in seen:
        assert 4 % d.tp == 0 and 2 * d.cp <= 12 and 8 % d.dp_degree == 0
        assert d.tp == 1 or d.cp == 1  # fsdp applies one of them in the blocks
        d.check(world_size=16, num_heads=4, global_batch_size=8, max_seq_len=12)  # the run's own checks agree
    assert {d.cp for d in seen} == {1, 2, 4} and max(d.tp for d in seen) == 4


def test_naive_order_puts_the_first_declared_dim_innermost():
    assert NAIVE_ORDER["mesh_order"][-1] == "dp_replicate" and set(NAIVE_ORDER["mesh_order"]) == set(MESH_DIMS)


def test_orders_are_those_fsdp_applies():
    from gem_model.api import ParallelDims

    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=2, sparse=4)
    seen = {d.mesh_order for d in orders(dims)}
    # dp_replicate outside dp_shard: 3 of the 6 orders of the three enabled dims, cp (degree 1) innermost
    assert seen == {("dp_replicate", "dp_shard", "tp", "cp"), ("dp_replicate", "tp", "dp_shard", "cp"),
                    ("tp", "dp_replicate", "dp_shard", "cp")}  # fmt: skip
    # dp_replicate alone keeps dp_shard (degree 1) inside it, as fsdp's mesh does
    assert [d.mesh_order for d in orders(ParallelDims(dp_replicate=4, dp_shard=1, sparse=4))] == [
        ("dp_replicate", "dp_shard", "cp", "tp")]  # fmt: skip
    assert {d.sparse_groups for d in orders(dims.model_copy(update={"sparse": 2}))} == {"contiguous", "strided"}


def test_torchrec_is_told_the_sparse_group_and_its_budget():
    w = small()
    topo = sparse_topology(world_size=8, local_world_size=8, hbm_for_tables=30e9, intra_bw=450e9, inter_bw=50e9)
    assert topo.world_size == 8 and topo.local_world_size == 8
    assert topo.intra_host_bw == pytest.approx(450e6) and topo.devices[0].storage.hbm == int(30e9)
    plan = plan_sparse_group(w, topo, batch_size=32, sharding_types=["table_wise", "row_wise"])
    assert set(plan.sharding_types) == {"item", "user", "city"}
    assert sum(plan.table_bytes_per_rank) == pytest.approx(w.total_table_bytes)
    assert all(0 <= r < 8 for ranks in plan.table_ranks.values() for r in ranks)


def test_a_table_missing_from_torchrec_plan_is_an_error():
    w = small()
    topo = sparse_topology(world_size=4, local_world_size=4, hbm_for_tables=60e9, intra_bw=450e9, inter_bw=50e9)
    plan = plan_sparse_group(w, topo, batch_size=32, sharding_types=["row_wise"])
    more = small(tables=(*w.tables, TableSpec(name="dropped", num_rows=10, dim=8)))
    with pytest.raises(ValueError, match=r"does not place every table whole: dropped \(0 of 80 elements\)"):
        _check_and_count(more, plan.plan, 4)


def test_torchrec_refusal_becomes_an_error_naming_the_largest_table_and_the_shortfall():
    w = small()
    topo = sparse_topology(world_size=2, local_world_size=2, hbm_for_tables=5e9, intra_bw=450e9, inter_bw=50e9)
    with pytest.raises(PlanDoesNotFitError, match=r"need 103\.0 GB, the group has 10\.0 GB .*shortfall 93\.0 GB.* largest table 'user' \(51\.6 GB\)"):
        plan_sparse_group(w, topo, batch_size=32, sharding_types=["row_wise"])


def test_lookups_sum_the_tables_once():
    w = small()
    lk = Lookups.of(w)
    assert lk.seq_ids == pytest.approx(w.lengths.mean) and lk.pooled_ids == 2.0
    assert lk.seq_elems == pytest.approx(w.lengths.mean * 256) and lk.pooled_elems == 192.0
