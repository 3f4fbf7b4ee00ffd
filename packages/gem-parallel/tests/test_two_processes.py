"""Two gloo processes with torchrec-sharded tables train like one process, and resume exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiprocess


def gem_train(args: list[str], *, nproc: int = 1, timeout: int = 600, torchrun: bool = False) -> subprocess.CompletedProcess[str]:
    """``gem-train run`` in ``nproc`` processes (``torchrun``: under torchrun even for one process)."""
    env = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "OMP_NUM_THREADS": "1"}
    if torchrun:
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "gem_model", "run"]
    else:
        launch = ["-m", "gem_model", "run", *(["--nproc", str(nproc)] if nproc > 1 else [])]
    cmd = [sys.executable, *launch, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def step_losses(path: Path) -> list[float]:
    return [json.loads(x)["step_loss"] for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_sharded_run_matches_one_process_and_resumes_exactly(reference_overrides, tmp_path):
    """One process steps the tables with torch's optimizer; two step them inside FBGEMM's fused kernels."""
    steps = ["trainer.steps=6", "trainer.checkpoint_every=3", "trainer.checkpoint_at_end=false"]
    gem_train([*reference_overrides, *steps, "parallel.planner=single", f"trainer.output_dir={tmp_path}/one"])
    two = gem_train(
        [*reference_overrides, *steps, "parallel.planner=torchrec_ddp", f"trainer.output_dir={tmp_path}/two"], nproc=2
    )
    assert "tables sharded over 2 ranks" in two.stdout
    one_losses, two_losses = step_losses(tmp_path / "one"), step_losses(tmp_path / "two")
    assert len(one_losses) == len(two_losses) == 6
    # same global batches, same initial tables; only the order of float sums differs
    for a, b in zip(one_losses, two_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (one_losses, two_losses)

    # resume the sharded run from its step-3 checkpoint: steps 4..6 must repeat bit for bit
    run_dir = tmp_path / "two"
    (run_dir / "metrics.jsonl").unlink()
    gem_train(
        [*reference_overrides, "trainer.steps=6", "trainer.resume=true", "trainer.checkpoint_at_end=false",
         "parallel.planner=torchrec_ddp", f"trainer.output_dir={run_dir}"],
        nproc=2,
    )
    assert step_losses(run_dir) == two_losses[3:]


def test_warmup_reaches_the_fused_table_optimizer(reference_overrides, tmp_path):
    """FBGEMM fixes a step's table learning rate in the lookup's forward: a warm-up set any later
    would lag a step behind the one-process run, whose torch optimizer reads it at ``step()``."""
    common = [*reference_overrides, "trainer.steps=4", "trainer.warmup_steps=3", "trainer.checkpoint_at_end=false"]
    gem_train([*common, "parallel.planner=single", f"trainer.output_dir={tmp_path}/one"])
    gem_train([*common, "parallel.planner=torchrec_ddp", f"trainer.output_dir={tmp_path}/two"], nproc=2)
    # one process under torchrun: a process group of one rank, as on a single GPU
    gem_train([*common, "parallel.planner=torchrec_ddp", f"trainer.output_dir={tmp_path}/alone"], torchrun=True)
    one_losses = step_losses(tmp_path / "one")
    assert len(one_losses) == 4
    for other in ("two", "alone"):
        losses = step_losses(tmp_path / other)
        for a, b in zip(one_losses, losses, strict=True):
            assert abs(a - b) <= 1e-5 * abs(a), (other, one_losses, losses)
