"""``gem-train run`` as a subprocess for gem-parallel's multi-process tests (not a test module)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from gem_model.testing import run_until

ENV = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "OMP_NUM_THREADS": "1"}


def gem_train(
    args: list[str], *, nproc: int = 1, timeout: int = 600, torchrun: bool = False, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``gem-train run`` in ``nproc`` processes (``torchrun``: under torchrun even for one process)."""
    if torchrun:
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "gem_model", "run"]
    else:
        launch = ["-m", "gem_model", "run", *(["--nproc", str(nproc)] if nproc > 1 else [])]
    cmd = [sys.executable, *launch, *args]
    proc = run_until(cmd, env={**ENV, **(env or {})}, timeout_s=timeout)  # a hang fails with the ranks' stacks
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def step_losses(path: Path) -> list[float]:
    return [json.loads(x)["step_loss"] for x in (path / "metrics.jsonl").read_text().splitlines() if "step_loss" in x]


def gem_train_failing(args: list[str], *, nproc: int = 2, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """``gem-train run`` under torchrun in ``nproc`` processes (the launcher's own imports left out),
    for a run that must fail: its process, whose non-zero status is asserted."""
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "gem_model", "run"]
    proc = run_until([sys.executable, *launch, *args], env=ENV, timeout_s=timeout)
    assert proc.returncode != 0, proc.stderr[-3000:]
    return proc


def rank_digests(path: Path, rank: int) -> dict[int, dict]:
    """``inline_digests``'s records of ``rank`` by step (counted from 1)."""
    lines = [json.loads(x) for x in (path / f"rank{rank}.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines}
