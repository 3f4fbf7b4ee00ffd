"""The layout: named dims and degrees, this rank's coordinates, each dim's group, the dp share."""

from __future__ import annotations

import pytest
import torch

from gem_model import testing
from gem_model.distributed import DistEnv
from gem_model.layout import Layout
from gem_model.parallel_dims import ParallelDims


def dims(**degrees: int) -> ParallelDims:
    return ParallelDims(**{"dp_shard": 1, "sparse": 1, **degrees})


def test_data_parallel_layout_is_one_dim_over_the_world():
    layout = Layout.data_parallel(rank=3, world_size=4, group="g")
    assert layout.world_size == 4 and layout.rank == 3
    assert (layout.dp_rank, layout.dp_degree, layout.loss_degree) == (3, 4, 4)
    assert layout.loss_group == "g" and layout.group("dp_replicate") == "g"
    assert layout.describe() == {"degrees": {"dp_replicate": 4}, "world_size": 4}
    assert str(layout) == "dp_replicate=4 (4 ranks)"


def test_tensor_parallel_ranks_read_the_same_share_and_reduce_over_data_x_context():
    # mesh dp_shard=2 x cp=2 x tp=2, row-major: rank = ((dp * 2) + cp) * 2 + tp
    groups = {"dp_shard": "dp", "cp": "cp", "tp": "tp", "dp_shard+cp": "dp+cp"}
    ranks = {}
    for dp in range(2):
        for cp in range(2):
            for tp in range(2):
                rank = (dp * 2 + cp) * 2 + tp
                layout = Layout(dims(dp_shard=2, cp=2, tp=2), rank, groups=groups)
                assert layout.coords == {"dp_shard": dp, "cp": cp, "tp": tp}
                ranks[layout.rank] = layout
    assert sorted(ranks) == list(range(8))
    assert [ranks[r].dp_rank for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {layout.dp_degree for layout in ranks.values()} == {2}
    assert ranks[5].loss_degree == 4 and ranks[5].loss_group == "dp+cp"
    # dp_replicate has degree 1: not in the mesh, ignored in a group's dims
    assert ranks[5].group("tp") == "tp" and ranks[5].group("dp_replicate", "tp") == "tp"
    assert ranks[5].enabled("cp") and not ranks[5].enabled("dp_replicate") and ranks[5].degree("dp_replicate") == 1


def test_one_rank_needs_no_group():
    layout = Layout.data_parallel(rank=0, world_size=1)
    assert layout.loss_group is None and layout.loss_degree == 1


def test_a_flattened_group_the_planner_did_not_make_is_an_error():
    layout = Layout(dims(dp_replicate=2, cp=2), 1, groups={"dp_replicate": "a", "cp": "b"})
    assert layout.coords == {"dp_replicate": 0, "cp": 1}
    with pytest.raises(KeyError, match=r"no process group over 'dp_replicate\+cp'"):
        layout.loss_group


@pytest.mark.parametrize(
    ("degrees", "rank", "mesh_dims", "message"),
    [
        ({"tp": 2}, 0, ("xp",), "unknown dim"),
        ({"tp": 2}, 2, (), r"rank 2 is not in \[0, 2\)"),
        ({"tp": 2, "cp": 2}, 0, ("tp",), r"dim\(s\) \['cp'\] have degree above 1 but are not mesh dims"),
        ({"tp": 2}, 0, ("tp", "dp_shard"), "not in the mesh order"),
    ],
)
def test_bad_layouts_are_refused(degrees, rank, mesh_dims, message):
    with pytest.raises(ValueError, match=message):
        Layout(dims(**degrees), rank, mesh_dims)


def test_degrees_are_at_least_one_and_must_be_resolved():
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        dims(tp=0)
    with pytest.raises(ValueError, match="not resolved"):
        Layout(ParallelDims(tp=2), 0)  # dp_shard = 0: not filled from a world size


def test_unknown_dim_in_a_query_is_refused():
    with pytest.raises(ValueError, match="unknown dim 'dp'"):
        Layout.data_parallel(rank=0, world_size=1).degree("dp")
    with pytest.raises(ValueError, match="unknown dim 'pp'"):
        Layout.data_parallel(rank=0, world_size=1).degree("pp")  # no planner here has pipeline stages


def test_planner_default_layout_and_the_replicated_test_planner():
    env = DistEnv(1, 2, 1, torch.device("cpu"), None)
    assert testing.Single().layout(DistEnv(0, 1, 0, torch.device("cpu"), None)).describe()["degrees"] == {"dp_replicate": 1}
    layout = testing.Replicated().layout(env)
    assert layout.degrees == {"tp": 2} and layout.dp_degree == 1 and layout.dp_rank == 0 and layout.loss_degree == 1


class TwoRankLayout(testing.Single):
    name = "inline_two_rank_layout"

    def layout(self, env):
        return Layout.data_parallel(rank=0, world_size=2)


class TwoRankPlugin:
    from gem_model import hookimpl

    @hookimpl
    def gem_register_parallel_planners(self):
        return [TwoRankLayout]


def test_a_layout_that_does_not_cover_the_processes_is_refused(pm, tiny_overrides):
    from gem_model.config_io import load_config
    from gem_model.trainer import train

    pm.register(TwoRankPlugin(), name="two-rank")
    with pytest.raises(ValueError, match=r"'inline_two_rank_layout' made the layout dp_replicate=2 \(2 ranks\), but the run has 1"):
        train(load_config(None, [*tiny_overrides, "parallel.planner=inline_two_rank_layout"]), pm)


def test_a_one_rank_mesh_dim_hands_out_the_group_the_planner_stored():
    # a mesh dim of degree 1 still has a (one-rank) process group: callers that need a real group
    # (torchrec's sharders) get it; a dim outside the mesh, or a layout without groups, has none
    layout = Layout(dims(tp=2), 1, ("dp_replicate", "tp"), {"dp_replicate": "one", "tp": "tp"})
    assert layout.group("dp_replicate") == "one" and layout.loss_group == "one" and layout.loss_degree == 1
    assert layout.group("dp_replicate", "tp") == "tp" and layout.group("cp") is None
    assert Layout(dims(), 0).group("dp_replicate") is None
