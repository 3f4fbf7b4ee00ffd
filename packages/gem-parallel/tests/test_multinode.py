"""Two "nodes" on 127.0.0.1 (two torchrun launches with --nnodes 2, c10d rendezvous) train like one node
with the same world size."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gem_train(args: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "gem_model", "run", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def finish(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    return out + err


def step_losses(path: Path) -> list[float]:
    return [json.loads(x)["step_loss"] for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_two_nodes_match_one_node_of_the_same_world_size(reference_overrides, tmp_path):
    common = [*reference_overrides, "trainer.steps=3", "trainer.checkpoint_at_end=false", "parallel.planner=torchrec_ddp"]
    endpoint = f"127.0.0.1:{free_port()}"
    # all three launches at once: most of their time is starting Python and importing torch
    one_node = gem_train(["--nproc", "2", *common, f"trainer.output_dir={tmp_path}/one"])
    nodes = [
        gem_train(["--nnodes", "2", "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes",
                   *common, f"trainer.output_dir={tmp_path}/two"])
        for rank in range(2)
    ]  # fmt: skip
    try:
        finish(one_node)
        outputs = [finish(p) for p in nodes]
    finally:
        for proc in (one_node, *nodes):
            if proc.poll() is None:  # a launch failed: end the others it left waiting at the rendezvous
                proc.kill()
                proc.wait()
    # global rank 0 prints the summary, on whichever node the rendezvous gave it; each node says which
    summaries = [bool(re.search(r"processes\s+2 on cpu", out)) for out in outputs]
    assert sorted(summaries) == [False, True]
    here = summaries.index(True)
    assert "progress and the run summary show here (global rank 0)" in outputs[here]
    assert "on the node that holds global rank 0" in outputs[1 - here]
    assert not any("node_rank is only used" in out or "Warning" in out for out in outputs)
    one, two = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two, strict=True):
        assert abs(a - b) <= 1e-6 * abs(a), (one, two)
