"""The README's commands on the installed packages: plugins, the default run, two processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gem_model.testing_runs import run_until  # not gem_model.testing: no torch in this process


def gem_train(*args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GEM_DISABLE_PLUGIN_AUTOLOAD", None)
    return run_until([sys.executable, "-m", "gem_model", *args], env=env, timeout_s=timeout)  # a hang shows its stacks


ROOT = Path(__file__).resolve().parents[1]


def assert_quiet(proc: subprocess.CompletedProcess[str]) -> None:
    """No warning a user cannot act on: none from torch, torchrec, fbgemm or torchrun (gem_model.quiet)."""
    out = proc.stdout + proc.stderr
    assert not re.search(r"(?i)\bwarning\b|\*{20}", out), out[-5000:]


def test_plugins_lists_all_five_packages_and_their_names():
    out = gem_train("plugins").stdout
    for dist in ("gem-model", "gem-kernels", "gem-precision", "gem-parallel", "gem-comm"):
        assert f"  {dist} 0.1.0" in out
    for name in ("torchrec_ddp", "single", "default", "fp32", "bf16", "triton", "synthetic", "round_robin"):
        assert f"  {name}" in out


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> tuple[tuple[str, ...], subprocess.CompletedProcess[str], Path]:
    """The main command (the default run, 20 steps) in a fresh output directory: its arguments, its
    process and the run's directory (for the first two tests: the second runs it again)."""
    out = tmp_path_factory.mktemp("default")
    args = ("run", "trainer.steps=20", f"trainer.output_dir={out}/{{name}}")
    return args, gem_train(*args), out / "gem-tiny"


def test_default_run_trains_and_prints_the_summary(default_run):
    _, proc, out = default_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== summary" in proc.stdout and "MFU" in proc.stdout
    assert_quiet(proc)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]


def test_the_main_command_twice_in_a_row(default_run):
    args, first, out = default_run
    assert first.returncode == 0, first.stderr[-3000:]
    logged = (out / "metrics.jsonl").read_text()
    second = gem_train(*args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "nothing to train" in second.stdout and "step 20 of trainer.steps=20" in second.stdout
    assert_quiet(second)
    # log_every 10: steps 10 and 20, from the first run; the second logs nothing
    assert len(logged.splitlines()) == 2 and (out / "metrics.jsonl").read_text() == logged


COMMON = ["trainer.steps=4", "trainer.log_every=1", "data.global_batch_size=16", "trainer.checkpoint_at_end=false"]


def _step_losses(out: Path) -> list[float]:
    return [json.loads(x)["step_loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The output directory of a one-process run of :data:`COMMON` (paid by the first test that asks)."""
    out = tmp_path_factory.mktemp("one")
    proc = gem_train("run", *COMMON, f"trainer.output_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_one_process_with_the_real_plugins_logs_every_step(one_process):
    losses = _step_losses(one_process)
    assert len(losses) == 4 and all(x == x and x > 0 for x in losses), losses


@pytest.mark.multiprocess
def test_two_processes_with_the_real_plugins(tmp_path, one_process):
    two = gem_train("run", "--nproc", "2", "parallel.planner=torchrec_ddp", *COMMON, f"trainer.output_dir={tmp_path}/two")
    assert two.returncode == 0, two.stderr[-3000:]
    assert_quiet(two)  # torchrun's OMP_NUM_THREADS banner and torchrec's warnings included
    a, b = _step_losses(one_process), _step_losses(tmp_path / "two")
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b, strict=True)), (a, b)


def test_plan_of_the_two_process_config_is_quiet():
    proc = gem_train("plan", "-c", str(ROOT / "configs" / "tiny-2proc.yaml"), "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "planner torchrec_ddp: dp_replicate=2" in proc.stdout
    assert_quiet(proc)
