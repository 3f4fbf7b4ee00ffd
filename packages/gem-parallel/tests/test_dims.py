"""The five named dimensions: checked before any process starts, each message naming its field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gem_model.errors import ConfigError
from gem_parallel.dims import DENSE_DIMS, MeshOrder, ParallelDims
from gem_parallel.topology import h200, place

RUN = {"world_size": 64, "num_heads": 8, "global_batch_size": 256, "max_seq_len": 4096}


def problems(dims: ParallelDims, **run) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        dims.check(**(RUN | run))
    return {path: msg for path, _, msg in info.value.problems}


def test_a_layout_that_fits_passes_and_reports_its_degrees():
    dims = ParallelDims(dp_replicate=2, dp_shard=4, tp=4, cp=2, sparse=16)
    dims.check(**RUN)
    assert dims.world_size == 64 and dims.dp_degree == 8 and dims.sparse_replicas == 4
    assert dims.enabled() == ("dp_replicate", "dp_shard", "tp", "cp", "sparse")
    assert ParallelDims().enabled() == ()


def test_the_dense_product_must_be_the_world_size():
    found = problems(ParallelDims(dp_shard=8, tp=2), world_size=32)
    assert "parallel.dims.dp_replicate x dp_shard x tp x cp" in found
    assert "multiply to 16, the world size is 32" in found["parallel.dims.dp_replicate x dp_shard x tp x cp"]


def test_each_degree_that_does_not_divide_is_named():
    found = problems(ParallelDims(dp_shard=3, tp=3, cp=3, sparse=5), world_size=27, global_batch_size=16, max_seq_len=64)
    assert "model.num_heads=8" in found["parallel.dims.tp"]
    assert "model.max_seq_len=64" in found["parallel.dims.cp"]
    assert "data.global_batch_size=16" in found["parallel.dims.dp_replicate x dp_shard"]
    assert "must divide the world size 27" in found["parallel.dims.sparse"]


def test_the_prefix_is_the_callers_config_path():
    found = problems(ParallelDims(tp=3, dp_shard=8), world_size=24, prefix="parallel.planner.options.dims")
    assert list(found) == ["parallel.planner.options.dims.tp"]


def test_degrees_are_positive_and_unknown_keys_are_refused():
    with pytest.raises(ValidationError, match="tp"):
        ParallelDims(tp=0)
    with pytest.raises(ValidationError, match="pp"):
        ParallelDims(pp=2)


def test_mesh_order_is_a_permutation_of_the_dense_dims():
    with pytest.raises(ValidationError, match="each of"):
        MeshOrder(outer_to_inner=("dp_shard", "dp_shard", "cp", "tp"))
    with pytest.raises(ValidationError):
        MeshOrder(outer_to_inner=("sparse", "dp_shard", "cp", "tp"))


def test_coordinates_are_row_major_with_the_innermost_dim_fastest():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=4, sparse=4)
    order = MeshOrder(outer_to_inner=("dp_replicate", "dp_shard", "cp", "tp"))
    seen = {tuple(order.coordinates(r, dims)[n] for n in DENSE_DIMS) for r in range(16)}
    assert len(seen) == 16  # every rank a distinct place in the dense mesh
    assert order.coordinates(1, dims)["tp"] == 1 and order.coordinates(4, dims)["dp_shard"] == 1
    assert order.coordinates(5, dims)["sparse"] == 1  # contiguous groups: ranks 4..7 are one group
    strided = MeshOrder(outer_to_inner=order.outer_to_inner, sparse_groups="strided")
    assert strided.strides(dims)["sparse"] == 4 and strided.coordinates(4, dims)["sparse"] == 1


def test_placement_maps_inner_dims_to_nvlink_and_outer_to_the_network():
    topo = h200(4)  # 32 GPUs
    dims = ParallelDims(dp_replicate=4, dp_shard=2, tp=4, sparse=16)
    pl = place(dims, MeshOrder(outer_to_inner=("dp_replicate", "cp", "dp_shard", "tp")), topo)
    assert (pl["tp"].link, pl["dp_shard"].link, pl["dp_replicate"].link, pl["cp"].link) == (
        "nvlink", "nvlink", "network", "none"
    )
    assert pl["sparse"].link == "mixed" and pl["sparse"].members_per_node == 8
    pl = place(dims, MeshOrder(outer_to_inner=("tp", "cp", "dp_shard", "dp_replicate")), topo)
    assert (pl["tp"].link, pl["dp_shard"].link, pl["dp_replicate"].link) == ("network", "nvlink", "nvlink")
    assert pl["tp"].members_per_node == 1 and pl["tp"].nodes_spanned == 4
    with pytest.raises(ValueError, match="make 32 ranks, the topology 2x8 has 16"):
        place(dims, MeshOrder(), h200(2))
