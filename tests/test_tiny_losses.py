"""configs/tiny.yaml on the installed packages, pinned bit for bit for 1 and 2 processes: recorded
before the core seams (layout, plan/apply, train pipelines, run context) went in."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gem_model.testing import assert_pinned, run_until

ROOT = Path(__file__).resolve().parents[1]
# 4 steps of configs/tiny.yaml (torch kernels, fp32, default comm), by process count, per CPU family
AVX2 = "AVX2 CI machine, 4ddf59e"
SPR = "AVX-512 + AMX (Sapphire Rapids), b9cca1e"
AMD = "AVX-512 AMD EPYC (no AMX), cb0a341"
PINNED = {
    1: {
        AVX2: ["0x1.24094277126b8p+3", "0x1.e83b5d2da2c6ap+2", "0x1.e98e3d874a882p+2", "0x1.c9c7999501796p+2"],
        SPR: ["0x1.24094277126b8p+3", "0x1.e83b5d6da2c6ap+2", "0x1.e98e3d474a882p+2", "0x1.c9c79d8351133p+2"],
        AMD: ["0x1.240942b7126b8p+3", "0x1.e83b5af9d6835p+2", "0x1.e98e4028afb52p+2", "0x1.c9c7999501796p+2"],
    },
    2: {
        AVX2: ["0x1.240943378ab6bp+3", "0x1.e83b5c33bca50p+2", "0x1.e98e3c1697f1ap+2", "0x1.c9c79ab0955fdp+2"],
        SPR: ["0x1.240943578ab6bp+3", "0x1.e83b5d4da2c6ap+2", "0x1.e98e3c5697f1ap+2", "0x1.c9c79ad0955fdp+2"],
        AMD: ["0x1.240943678ab6bp+3", "0x1.e83b5d2da2c6ap+2", "0x1.e98e3bf697f1ap+2", "0x1.c9c79f7a78e01p+2"],
    },
}
RUN = ["trainer.steps=4", "trainer.progress=false", "trainer.log_every=1", "trainer.checkpoint_at_end=false",
       "trainer.eval_at_end=false"]  # fmt: skip


def tiny_losses(tmp_path: Path, nproc: int) -> list[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GEM_DISABLE_PLUGIN_AUTOLOAD", None)
    procs = ["--nproc", "2"] if nproc == 2 else []
    planner = ["parallel.planner=torchrec_ddp"] if nproc == 2 else []
    cmd = [sys.executable, "-m", "gem_model", "run", *procs, "-c", str(ROOT / "configs" / "tiny.yaml"), *RUN, *planner]
    proc = run_until([*cmd, f"trainer.output_dir={tmp_path}"], env=env, timeout_s=900)  # a hang shows its stacks
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(x)["step_loss"].hex() for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_one_process_reproduces_the_pinned_losses(tmp_path):
    assert_pinned(tiny_losses(tmp_path, 1), PINNED[1], "tests/test_tiny_losses.py PINNED[1]")


@pytest.mark.multiprocess
def test_two_processes_reproduce_the_pinned_losses(tmp_path):
    assert_pinned(tiny_losses(tmp_path, 2), PINNED[2], "tests/test_tiny_losses.py PINNED[2]")
