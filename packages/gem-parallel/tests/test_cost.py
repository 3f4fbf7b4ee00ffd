"""The analytic cost model: collectives by hand, and the directions a planner relies on."""

from __future__ import annotations

import math

import pytest

from gem_model.api import ParallelDims
from gem_parallel.cost import all_to_all, estimate, ring
from gem_parallel.topology import Placement, h200, place
from gem_parallel.workload import gem_sized

TOPO = h200(4)


def by_dim(cost) -> dict:
    return {c.dim: c for c in cost.per_dim}


def test_ring_collectives_by_hand():
    inside = Placement(dim="tp", degree=4, stride=1, members_per_node=4)
    sent, t = ring(inside, TOPO, 4e9)
    assert sent == pytest.approx(3e9) and t == pytest.approx(3e9 / 450e9 + 2 * 3e-6)
    across = Placement(dim="tp", degree=4, stride=8, members_per_node=1)
    sent, t = ring(across, TOPO, 4e9, allreduce=True)
    assert sent == pytest.approx(6e9) and t == pytest.approx(6e9 / 50e9 + 4 * 10e-6)
    assert ring(Placement(dim="tp", degree=1, stride=1, members_per_node=1), TOPO, 4e9) == (0.0, 0.0)


def test_all_to_all_sends_local_and_remote_parts_at_once():
    mixed = Placement(dim="sparse", degree=16, stride=1, members_per_node=8)
    sent, t = all_to_all(mixed, TOPO, 16e6)
    intra, inter = 16e6 * 7 / 16, 16e6 * 8 / 16
    assert sent == pytest.approx(intra + inter)
    assert t == pytest.approx(max(intra / 450e9, inter / 50e9) + 7 * 3e-6 + 8 * 10e-6)


def test_tp_inside_a_node_costs_less_than_across_nodes():
    w = gem_sized(global_batch_size=1024, pooled_tables=4)
    dims = ParallelDims(dp_shard=4, tp=8, sparse=32)
    inner = by_dim(estimate(dims.model_copy(update={"mesh_order": ("dp_replicate", "cp", "dp_shard", "tp")}), TOPO, w))
    outer = by_dim(estimate(dims.model_copy(update={"mesh_order": ("dp_replicate", "cp", "tp", "dp_shard")}), TOPO, w))
    assert inner["tp"].link == "nvlink" and outer["tp"].link == "mixed"  # 2 of each group per node
    assert inner["tp"].bytes_per_step == pytest.approx(outer["tp"].bytes_per_step)
    assert inner["tp"].seconds * 5 < outer["tp"].seconds


def test_sharding_the_dense_part_trades_memory_for_all_gathers():
    w = gem_sized(global_batch_size=1024, pooled_tables=4)
    replicated = estimate(ParallelDims(dp_replicate=32, dp_shard=1, sparse=32), TOPO, w)
    sharded = estimate(ParallelDims(dp_replicate=4, dp_shard=8, sparse=32), TOPO, w)
    assert sharded.memory.dense_states == pytest.approx(replicated.memory.dense_states / 8)
    assert by_dim(replicated)["dp_shard"].bytes_per_step == 0 < by_dim(sharded)["dp_shard"].bytes_per_step
    assert by_dim(sharded)["dp_replicate"].bytes_per_step < by_dim(replicated)["dp_replicate"].bytes_per_step


def test_one_sparse_group_has_no_replicas_to_sync_and_smaller_groups_do():
    w = gem_sized(global_batch_size=1024, pooled_tables=4)
    whole = by_dim(estimate(ParallelDims(dp_replicate=32, dp_shard=1, sparse=32), TOPO, w))
    half = by_dim(estimate(ParallelDims(dp_replicate=32, dp_shard=1, sparse=16), TOPO, w))
    assert whole["sparse_replicas"].bytes_per_step == 0 and whole["sparse_replicas"].degree == 1
    assert half["sparse_replicas"].degree == 2 and half["sparse_replicas"].bytes_per_step > 0
    # contiguous groups of 16 keep their replicas 16 ranks apart (another node); strided ones side by side
    strided = by_dim(estimate(ParallelDims(dp_replicate=32, dp_shard=1, sparse=16, sparse_groups="strided"), TOPO, w))
    assert half["sparse_replicas"].link == "network" and strided["sparse_replicas"].link == "nvlink"


def test_context_parallel_splits_tokens_and_activations():
    w = gem_sized(global_batch_size=1024, pooled_tables=4)
    plain = estimate(ParallelDims(dp_replicate=32, dp_shard=1, sparse=32), TOPO, w)
    cp = estimate(ParallelDims(dp_replicate=16, dp_shard=1, cp=2, sparse=32), TOPO, w)
    # half the data-parallel ranks, each sequence over two ranks: the same tokens per GPU
    assert cp.memory.activations == pytest.approx(plain.memory.activations)
    assert by_dim(cp)["cp"].collectives == 2 * w.num_layers and by_dim(plain)["cp"].collectives == 0
    assert math.isclose(by_dim(cp)["sparse"].bytes_per_step, by_dim(plain)["sparse"].bytes_per_step, rel_tol=0.2)


def test_placement_maps_inner_dims_to_nvlink_and_outer_to_the_network():
    topo = h200(4)  # 32 GPUs
    dims = ParallelDims(dp_replicate=4, dp_shard=2, tp=4, sparse=16, mesh_order=("dp_replicate", "cp", "dp_shard", "tp"))
    pl = place(dims, topo)
    assert (pl["tp"].link, pl["dp_shard"].link, pl["dp_replicate"].link, pl["cp"].link) == (
        "nvlink", "nvlink", "network", "none"
    )
    assert pl["sparse"].link == "mixed" and pl["sparse"].members_per_node == 8
    pl = place(dims.model_copy(update={"mesh_order": ("tp", "cp", "dp_shard", "dp_replicate")}), topo)
    assert (pl["tp"].link, pl["dp_shard"].link, pl["dp_replicate"].link) == ("network", "nvlink", "nvlink")
    assert pl["tp"].members_per_node == 1 and pl["tp"].nodes_spanned == 4
    with pytest.raises(ValueError, match="make 32 ranks, the topology 2x8 has 16"):
        place(dims, h200(2))
