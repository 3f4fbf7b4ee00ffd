"""gem-parallel's tests fill the other seams with gem_model.testing: no sibling package needed."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# pytest runs with --import-mode=importlib, which puts no test folder on sys.path; the multi-process
# tests share parallel_runs from this folder
sys.path.insert(0, str(Path(__file__).resolve().parent))
from parallel_runs import gem_train, step_losses

REFERENCE = [
    "kernels.jagged_attention=loop",
    "kernels.norm_gate=loop",
    "precision.scheme=inline_fp32",
    "activation.policy=inline_none",
    "comm.strategy=inline_comm",
    "trainer.progress=false",
    "trainer.log_every=1",
    "data.global_batch_size=16",
    "data.source.options.max_len=15",
    "model.max_seq_len=16",
]


@pytest.fixture
def reference_overrides(tmp_path) -> list[str]:
    return [*REFERENCE, f"trainer.output_dir={tmp_path}/{{name}}"]


@dataclass
class Finished:
    args: list[str]
    """The run's overrides (``trainer.output_dir`` included)."""
    out: Path
    stdout: str
    losses: list[float]


# 6 steps of REFERENCE, the first 3 warming up (trainer.warmup_steps), a checkpoint after step 3 (the only one)
SHARED = ["trainer.steps=6", "trainer.warmup_steps=3", "trainer.checkpoint_every=3", "trainer.checkpoint_at_end=false",
          "trainer.eval_at_end=false"]  # fmt: skip


def _run(out: Path, planner: str, nproc: int) -> Finished:
    args = [*REFERENCE, *SHARED, f"parallel.planner={planner}", f"trainer.output_dir={out}"]
    proc = gem_train(args, nproc=nproc, env={"PYTHONHASHSEED": "0"})
    return Finished(args, out, proc.stdout, step_losses(out))


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory) -> Finished:
    """One ``gem-train run --nproc 2`` of :data:`SHARED` under ``torchrec_ddp``, for the tests that read
    a two-process run. ``PYTHONHASHSEED=0``: torchrec's planner breaks ties between equally costed
    sharding types in set order, so the plan it saved is the one ``gem-train plan`` prints under that seed."""
    return _run(tmp_path_factory.mktemp("ddp") / "run", "torchrec_ddp", 2)


@pytest.fixture(scope="session")
def single_run(tmp_path_factory) -> Finished:
    """The same run in one process under ``single``: torch's optimizer steps the tables."""
    return _run(tmp_path_factory.mktemp("single") / "run", "single", 1)
