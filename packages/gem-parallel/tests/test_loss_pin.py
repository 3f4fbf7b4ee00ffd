"""The tiny run's losses through the real planners, pinned bit for bit for 1 and 2 processes:
recorded before the layout and plan/apply split went in, and reproduced after it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gem_model.testing import assert_pinned, run_until

# trainer.steps=4 of the REFERENCE overrides (conftest.py), by planner, per CPU family (assert_pinned)
AVX2 = "AVX2 CI machine, 4ddf59e"
SPR = "AVX-512 + AMX (Sapphire Rapids), b9cca1e"
AMD = "AVX-512 AMD EPYC (no AMX), cb0a341"
PINNED = {
    "single": {
        AVX2: ["0x1.1dfc7cc52640cp+3", "0x1.f38f93d96cb66p+2", "0x1.05a5b3a1dae60p+3", "0x1.09b436a58469fp+3"],
        SPR: ["0x1.1dfc7cc52640cp+3", "0x1.f38f94196cb66p+2", "0x1.05a5b1c6f4deap+3", "0x1.09b4380000000p+3"],
        AMD: ["0x1.1dfc7d052640cp+3", "0x1.f38f94196cb66p+2", "0x1.05a5b1e6f4deap+3", "0x1.09b436a58469fp+3"],
    },
    "torchrec_ddp": {
        AVX2: ["0x1.1dfc7c48d3dcbp+3", "0x1.f38f95fa4d269p+2", "0x1.05a5b3d1dae60p+3", "0x1.09b4381d3dcb0p+3"],
        SPR: ["0x1.1dfc7cc52640cp+3", "0x1.f38f965a4d269p+2", "0x1.05a5b3667e252p+3", "0x1.09b43732c2350p+3"],
        AMD: ["0x1.1dfc7c18d3dcbp+3", "0x1.f38f967abd5ebp+2", "0x1.05a5b295ae608p+3", "0x1.09b438ea7b961p+3"],
    },
}
RUN = ["trainer.steps=4", "trainer.checkpoint_at_end=false", "trainer.eval_at_end=false"]


def losses(args: list[str], out: Path, nproc: int) -> list[str]:
    env = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "gem_model", "run", *(["--nproc", str(nproc)] if nproc > 1 else []), *args]
    proc = run_until([*cmd, f"trainer.output_dir={out}"], env=env, timeout_s=600)  # a hang fails with the stacks
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(x)["step_loss"].hex() for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_single_reproduces_the_pinned_losses(reference_overrides, tmp_path):
    out = losses([*reference_overrides, *RUN, "parallel.planner=single"], tmp_path / "one", 1)
    assert_pinned(out, PINNED["single"], "packages/gem-parallel/tests/test_loss_pin.py PINNED['single']")


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "options",
    [[], ["parallel.planner.options.cache_recat=false"], ["trainer.loss_check=before_tables"]],
    ids=["plain", "no_recat_cache", "loss_check_at_tables"],
)
def test_torchrec_ddp_on_two_processes_reproduces_the_pinned_losses(reference_overrides, tmp_path, options):
    """The defaults (torchrec's input-distribution permutation made once per shape, gem_parallel.recat_cache),
    also without that cache, and with the loss read at the tables' gate inside backward, normalised on the
    device (gem_model.train.loss_check): the same bits."""
    args = [*reference_overrides, *RUN, "parallel.planner=torchrec_ddp", *options]
    out = losses(args, tmp_path / "two", 2)
    assert_pinned(out, PINNED["torchrec_ddp"], "packages/gem-parallel/tests/test_loss_pin.py PINNED['torchrec_ddp']")
