"""``gem-train run`` as a subprocess for gem-parallel's multi-process tests (not a test module)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **(env or {})}, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def step_losses(path: Path) -> list[float]:
    return [json.loads(x)["step_loss"] for x in (path / "metrics.jsonl").read_text().splitlines() if "step_loss" in x]
