"""Two "nodes" on 127.0.0.1 (two torchrun launches with --nnodes 2, c10d rendezvous) train like one node
with the same world size (the two-process run of conftest's ``ddp_run``, which an earlier module of this
folder has already made: counted here, its ~24 s took this test past a minute on the CI matrix)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest
from parallel_runs import step_losses

from gem_model.testing import RunTimedOut, start_run
from gem_model.testing import finish as finish_run

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gem_train(args: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "gem_model", "run", *args]
    return start_run(cmd, env=env)


def finish(proc: subprocess.Popen[str]) -> str:
    done = finish_run(proc, timeout_s=600)  # a hang fails with the node's ranks' stacks
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


def test_two_nodes_match_one_node_of_the_same_world_size(ddp_run, tmp_path):
    # the first 3 of the one-node run's 6 steps (no schedule depends on trainer.steps)
    common = [*ddp_run.args, "trainer.steps=3", f"trainer.output_dir={tmp_path}/two"]
    endpoint = f"127.0.0.1:{free_port()}"
    # both launches at once: they meet at the rendezvous
    nodes = [
        gem_train(["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes", *common])
        for rank in range(2)
    ]  # fmt: skip
    try:
        outputs = [finish(p) for p in nodes]
    finally:
        for proc in nodes:
            if proc.poll() is None:  # a launch failed: end the other it left waiting (its stacks in the output)
                try:
                    finish_run(proc, timeout_s=0)
                except RunTimedOut as stopped:
                    print(f"the other node: {stopped}")
    # global rank 0 prints the summary, on whichever node the rendezvous gave it; each node says which
    summaries = [bool(re.search(r"processes\s+2 on cpu", out)) for out in outputs]
    assert sorted(summaries) == [False, True]
    here = summaries.index(True)
    assert "progress and the run summary show here (global rank 0)" in outputs[here]
    assert "on the node that holds global rank 0" in outputs[1 - here]
    assert not any("node_rank is only used" in out or "Warning" in out for out in outputs)
    one, two = ddp_run.losses[:3], step_losses(tmp_path / "two")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two, strict=True):
        assert abs(a - b) <= 1e-6 * abs(a), (one, two)
