"""Reshard on load: a torchrec_ddp checkpoint saved by 2 processes (the step-3 checkpoint of conftest's
``ddp_run``) loads at 1 and at 4; the sharded tables, their fused optimizer state, the dense
parameters and AdamW's state are those saved.

Each load runs ``trainer.steps`` equal to the checkpoint's step (nothing to train), and the
``inline_state_dump`` callback writes what the run loaded (DCP, collectively) before step 1.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gem_model import testing

pytestmark = pytest.mark.multiprocess

ENV = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "OMP_NUM_THREADS": "1"}


def gem_train(nproc: int, args: list[str], *, code: int = 0) -> subprocess.CompletedProcess[str]:
    """``gem-train run`` in ``nproc`` processes: through torchrun, or one process without it."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"] if nproc > 1 else []
    cmd = [sys.executable, *launcher, "-m", "gem_model", "run", *args]
    proc = testing.run_until(cmd, env=ENV, timeout_s=300)  # a hang fails with the ranks' stacks
    assert proc.returncode == code, proc.stderr[-4000:]
    return proc


def load_at(world: int, saved: Path, tmp_path: Path, args: list[str], *, code: int = 0):
    """Load ``saved`` in ``world`` processes; the state they loaded (None when refused) and the output."""
    out, dump = tmp_path / f"at{world}", tmp_path / f"loaded{world}"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(saved, out / "checkpoints" / saved.name)
    callback = f"callbacks=[{{name: inline_state_dump, options: {{path: '{dump}'}}}}]"
    proc = gem_train(world, [*args, f"trainer.output_dir={out}", "trainer.resume=true", callback], code=code)
    return (testing.checkpoint_tensors(dump) if code == 0 else None), proc, out / "checkpoints" / saved.name


def assert_equal(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> None:
    keys = [k for k in loaded if k.startswith(prefixes)]
    assert any(".ec." in k for k in keys) and any("exp_avg" in k for k in keys)  # tables, dense optimizer
    different = [k for k in keys if k not in expected or not torch.equal(loaded[k], expected[k])]
    assert not different, different


def test_a_two_process_checkpoint_loads_resharded_at_four(ddp_run, tmp_path):
    saved = ddp_run.out / "checkpoints" / "step_00000003"
    expected = testing.checkpoint_tensors(saved)
    loaded, proc, path = load_at(4, saved, tmp_path, [*ddp_run.args, "trainer.steps=3", "parallel.planner=torchrec_ddp"])
    assert f"resharded {path} from 2 to 4 processes" in proc.stdout, proc.stdout
    assert_equal(loaded, expected, ("model.", "dense_optimizer.", "sparse_optimizer."))  # FBGEMM's state too


def test_a_two_process_checkpoint_loads_at_one_without_the_fused_table_state_only_when_partial(ddp_run, tmp_path):
    """One process: torchrec_ddp needs two ranks, and the single planner steps the tables with torch's
    row-wise Adagrad, whose state FBGEMM's fused one cannot become: refused, naming it, unless partial.
    (Apart from the load at four: together the two took 53 s on a two-core machine.)"""
    saved = ddp_run.out / "checkpoints" / "step_00000003"
    expected = testing.checkpoint_tensors(saved)
    single = [*ddp_run.args, "trainer.steps=3", "parallel.planner=single"]
    _, proc, path = load_at(1, saved, tmp_path, single, code=2)
    assert f"{path} does not fit this run (nothing was loaded)" in proc.stderr
    assert "sparse_optimizer.state.sparse.ec.embeddings.item.weight.sum (checkpoint has none, this run [20000, 1])" in proc.stderr
    assert 'world size (2 -> 1), parallel.planner.name ("torchrec_ddp" -> "single")' in proc.stderr
    loaded, proc, path = load_at(1, saved, tmp_path, [*single, "trainer.resume_partial=true"])
    assert f"resharded {path} from 2 to 1 processes" in proc.stdout, proc.stdout
    assert_equal(loaded, expected, ("model.", "dense_optimizer."))
