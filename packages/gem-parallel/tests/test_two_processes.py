"""Two gloo processes with torchrec-sharded tables train like one process, warm-up included, and
resume exactly (conftest's ``ddp_run`` and ``single_run``: 6 steps, the first 3 warming up)."""

from __future__ import annotations

import shutil

import pytest
from parallel_runs import gem_train, step_losses

pytestmark = pytest.mark.multiprocess


def assert_close(one: list[float], other: list[float], what: str) -> None:
    # same global batches, same initial tables; only the order of float sums differs
    assert len(one) == len(other) == 6, (what, one, other)
    for a, b in zip(one, other, strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (what, one, other)


def test_sharded_run_matches_one_process_and_resumes_exactly(ddp_run, single_run, tmp_path):
    """One process steps the tables with torch's optimizer; two step them inside FBGEMM's fused kernels."""
    assert "tables sharded over 2 ranks" in ddp_run.stdout
    assert_close(single_run.losses, ddp_run.losses, "two processes")

    # resume the sharded run from its step-3 checkpoint (its only one): steps 4..6 must repeat bit for bit
    run_dir = tmp_path / "two"
    shutil.copytree(ddp_run.out / "checkpoints" / "step_00000003", run_dir / "checkpoints" / "step_00000003")
    gem_train([*ddp_run.args, "trainer.resume=true", f"trainer.output_dir={run_dir}"], nproc=2)
    assert step_losses(run_dir) == ddp_run.losses[3:]


def test_warmup_reaches_the_fused_table_optimizer(ddp_run, single_run, tmp_path):
    """FBGEMM fixes a step's table learning rate in the lookup's forward: a warm-up set any later
    would lag a step behind the one-process run, whose torch optimizer reads it at ``step()``."""
    assert "trainer.warmup_steps=3" in ddp_run.args
    assert_close(single_run.losses, ddp_run.losses, "two processes")
    # one process under torchrun: a process group of one rank, as on a single GPU
    gem_train([*ddp_run.args, f"trainer.output_dir={tmp_path}/alone"], torchrun=True)
    assert_close(single_run.losses, step_losses(tmp_path / "alone"), "alone under torchrun")
