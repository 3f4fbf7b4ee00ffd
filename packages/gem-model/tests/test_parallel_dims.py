"""The parallel degrees: filled from the world size, checked before any process starts (each message
naming its field), and the rank geometry the layout and the topology planner share."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gem_model.errors import ConfigError
from gem_model.parallel_dims import MESH_DIMS, ParallelDims

RUN = {"world_size": 64, "num_heads": 8, "global_batch_size": 256, "max_seq_len": 4096}


def problems(dims: ParallelDims, **run) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        dims.check(**(RUN | run))
    return {path: msg for path, _, msg in info.value.problems}


def test_a_layout_that_fits_passes_and_reports_its_degrees():
    dims = ParallelDims(dp_replicate=2, dp_shard=4, tp=4, cp=2, sparse=16)
    dims.check(**RUN)
    assert dims.world_size == 64 and dims.dp_degree == 8 and dims.loss_degree == 16 and dims.sparse_replicas == 4
    assert dims.enabled_dims == ("dp_replicate", "dp_shard", "cp", "tp") and dims.enabled("sparse")
    assert ParallelDims(dp_shard=1, sparse=1).enabled_dims == ()
    assert str(dims) == "dp_replicate=2 x dp_shard=4 x cp=2 x tp=4 x sparse=16"


def test_fill_values_take_what_the_world_leaves():
    dims = ParallelDims(dp_replicate=2, tp=2).resolve(8)
    assert (dims.dp_shard, dims.sparse, dims.world_size) == (2, 8, 8)
    with pytest.raises(ConfigError, match=r"options\.dp_replicate x cp x tp: must divide the world size 4 .*got '3 x 1 x 1'"):
        ParallelDims(dp_replicate=3).resolve(4)
    with pytest.raises(ValueError, match="not resolved"):
        ParallelDims(tp=2).world_size


def test_the_mesh_product_must_be_the_world_size():
    found = problems(ParallelDims(dp_shard=8, tp=2, sparse=1), world_size=32)
    assert "multiply to 16, but the world size is 32" in found["parallel.planner.options.dp_replicate x dp_shard x cp x tp"]


def test_each_degree_that_does_not_fit_is_named_with_the_field_it_must_fit():
    found = problems(ParallelDims(dp_shard=3, tp=3, cp=5, sparse=7), world_size=45, global_batch_size=16, max_seq_len=8)
    assert "model.num_heads = 8" in found["parallel.planner.options.tp"]
    assert "model.max_seq_len = 8" in found["parallel.planner.options.cp"]
    assert "3 data-parallel ranks (parallel.planner.options.dp_replicate x dp_shard = 1 x 3)" in found["data.global_batch_size"]
    assert "must divide the world size 45" in found["parallel.planner.options.sparse"]
    # a cp group may have as many head-tail chunks as the longest sequence has rows, not more
    ParallelDims(dp_shard=1, cp=4, sparse=1).check(**(RUN | {"world_size": 4, "max_seq_len": 8}))


def test_the_prefix_is_the_callers_config_path():
    found = problems(ParallelDims(tp=3, dp_shard=8, sparse=1), world_size=24, where="parallel.planner.options.dims")
    assert list(found) == ["parallel.planner.options.dims.tp"]


def test_degrees_are_positive_and_unknown_keys_are_refused():
    with pytest.raises(ValidationError, match="tp"):
        ParallelDims(tp=0)
    with pytest.raises(ValidationError, match="pp"):
        ParallelDims(pp=2)
    with pytest.raises(ValueError, match="unknown dim 'pp'"):
        ParallelDims().degree("pp")


def test_mesh_order_is_a_permutation_of_the_mesh_dims():
    with pytest.raises(ValidationError, match="each of"):
        ParallelDims(mesh_order=("dp_shard", "dp_shard", "cp", "tp"))
    with pytest.raises(ValidationError):
        ParallelDims(mesh_order=("sparse", "dp_shard", "cp", "tp"))


def test_coordinates_are_row_major_with_the_innermost_dim_fastest():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=4, sparse=4)
    seen = {tuple(dims.coordinates(r)[n] for n in MESH_DIMS) for r in range(16)}
    assert len(seen) == 16  # every rank a distinct place in the mesh
    assert dims.coordinates(1)["tp"] == 1 and dims.coordinates(4)["dp_shard"] == 1
    assert dims.coordinates(5)["sparse"] == 1  # contiguous groups: ranks 4..7 are one group
    assert dims.sparse_group_ranks(5) == [4, 5, 6, 7]
    strided = dims.model_copy(update={"sparse_groups": "strided"})
    assert strided.strides()["sparse"] == 4 and strided.coordinates(4)["sparse"] == 1
    assert strided.sparse_group_ranks(5) == [1, 5, 9, 13]  # every 4th rank: its replicas are neighbours
    tp_outer = dims.model_copy(update={"mesh_order": ("tp", "dp_replicate", "dp_shard", "cp")})
    assert tp_outer.coordinates(1)["dp_shard"] == 1 and tp_outer.coordinates(4)["tp"] == 1


def test_a_mesh_keeps_the_dims_a_planner_asks_for():
    dims = ParallelDims(dp_replicate=4, dp_shard=1, sparse=1)
    assert dims.mesh_dims() == ("dp_replicate",) and dims.mesh_dims(keep=("dp_shard",)) == ("dp_replicate", "dp_shard")
    assert ParallelDims(dp_shard=1, sparse=1).mesh_dims(keep=("dp_shard",)) == ("dp_shard",)
