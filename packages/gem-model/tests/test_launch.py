"""``gem-train run``'s launch options: what it hands to torchrun, and what it refuses before starting anything."""

from __future__ import annotations

import sys

import pytest

from gem_model.cli import build_parser, main
from gem_model.launch import (
    CUDA_ALLOCATOR,
    NODE_RANK_ENV,
    node_notice,
    set_cuda_allocator,
    torchrun_argv,
    torchrun_env,
)


def run_args(*argv: str):
    return build_parser().parse_args(["run", *argv])


def test_one_node_is_standalone():
    argv = torchrun_argv(run_args("--nproc", "4"), ["-c", "run.yaml", "trainer.steps=3"])
    assert argv == [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
        "-m", "gem_model", "run", "-c", "run.yaml", "trainer.steps=3",
    ]  # fmt: skip


def test_several_nodes_meet_through_c10d_rendezvous():
    args = run_args("--nnodes", "2", "--node-rank", "1", "--nproc", "8", "--rdzv-endpoint", "node0:29500", "--rdzv-id", "job7")
    argv = torchrun_argv(args, ["a.b=1"])
    # c10d numbers the nodes as they join: torchrun ignores --node-rank (and warns), so the node's
    # number travels to its processes for the line each node prints instead
    assert argv[3:8] == [
        "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=node0:29500", "--rdzv-id=job7", "--nproc-per-node=8",
    ]  # fmt: skip
    assert "--standalone" not in argv and argv[-1] == "a.b=1" and not any("node-rank" in a for a in argv)
    assert torchrun_env(args)[NODE_RANK_ENV] == "1"


def test_each_node_says_which_global_ranks_it_got_and_where_the_progress_shows():
    worker = {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "LOCAL_RANK": "0", "RANK": "8", "GROUP_RANK": "1",
              NODE_RANK_ENV: "0"}  # fmt: skip
    notice = node_notice(worker)
    assert notice is not None and "node --node-rank 0" in notice and "as node 1 of 2" in notice
    assert "global ranks 8-15" in notice and "on the node that holds global rank 0" in notice
    first = node_notice({**worker, "RANK": "0", "GROUP_RANK": "0", NODE_RANK_ENV: "1"})
    assert first is not None and "progress and the run summary show here (global rank 0)" in first
    assert node_notice({**worker, "LOCAL_RANK": "3"}) is None  # once per node
    assert node_notice({**worker, "WORLD_SIZE": "8"}) is None  # one node: nothing to say


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2"], "--rdzv-endpoint: is needed with --nnodes > 1"),
        (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:1"], "--node-rank: must be in [0, 2)"),
        (["--nnodes", "2", "--rdzv-endpoint", "nohost"], "--rdzv-endpoint: must be host:port"),
        (["--nnodes", "0"], "--nnodes: must be at least 1"),
    ],
)
def test_bad_launch_options_exit_2_before_any_process_starts(capsys, monkeypatch, tiny_overrides, argv, message):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    assert main(["run", *argv, *tiny_overrides]) == 2
    assert message in capsys.readouterr().err


def test_the_world_of_all_nodes_must_fit_the_planner(capsys, monkeypatch, tiny_overrides):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    assert main(["run", "--nnodes", "2", "--rdzv-endpoint", "h:1", *tiny_overrides]) == 2
    assert "drives at most 1 process(es) but 2 were asked for" in capsys.readouterr().err


def test_the_cuda_allocator_grows_segments_unless_the_user_configured_it():
    env: dict[str, str] = {}
    set_cuda_allocator(env)
    assert env == {"PYTORCH_CUDA_ALLOC_CONF": CUDA_ALLOCATOR} and CUDA_ALLOCATOR == "expandable_segments:True"
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):  # the old name and torch's newer one
        mine = {name: "garbage_collection_threshold:0.8"}
        set_cuda_allocator(mine)
        assert mine == {name: "garbage_collection_threshold:0.8"}


@pytest.mark.parametrize("user_value", [None, "max_split_size_mb:512"])
def test_gem_train_hands_torchrun_the_allocator_setting(monkeypatch, tiny_overrides, torchrun_start, user_value):
    """``gem-train run --nproc 2`` starts torchrun with the allocator setting in its environment, or with the
    user's own untouched."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "placeholder")  # so that the test's changes are undone
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    if user_value is not None:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user_value)
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    with pytest.raises(torchrun_start.started):
        main(["run", "--nproc", "2", *tiny_overrides, "parallel.planner=inline_replicated"])
    ((_, env),) = torchrun_start.calls
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == (user_value or CUDA_ALLOCATOR)
