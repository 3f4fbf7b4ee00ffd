"""The README's commands on the installed packages: plugins, the default run, two processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


def gem_train(*args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GEM_DISABLE_PLUGIN_AUTOLOAD", None)
    return subprocess.run([sys.executable, "-m", "gem_model", *args], capture_output=True, text=True, env=env, timeout=timeout)


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


def test_default_run_trains_and_prints_the_summary(tmp_path):
    proc = gem_train("run", "trainer.steps=20", f"trainer.output_dir={tmp_path}/{{name}}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "== summary" in proc.stdout and "MFU" in proc.stdout
    assert_quiet(proc)
    records = [json.loads(x) for x in (tmp_path / "gem-tiny" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]


def test_the_main_command_twice_in_a_row(tmp_path):
    args = ("run", "trainer.steps=6", f"trainer.output_dir={tmp_path}/{{name}}")
    first = gem_train(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    second = gem_train(*args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "nothing to train" in second.stdout and "step 6 of trainer.steps=6" in second.stdout
    assert_quiet(second)
    assert len((tmp_path / "gem-tiny" / "metrics.jsonl").read_text().splitlines()) == 1  # log_every 10: step 6 only


@pytest.mark.multiprocess
def test_two_processes_with_the_real_plugins(tmp_path):
    common = ["trainer.steps=4", "trainer.log_every=1", "data.global_batch_size=16", "trainer.checkpoint_at_end=false"]
    one = gem_train("run", *common, f"trainer.output_dir={tmp_path}/one")
    two = gem_train("run", "--nproc", "2", "parallel.planner=torchrec_ddp", *common, f"trainer.output_dir={tmp_path}/two")
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert_quiet(two)  # torchrun's OMP_NUM_THREADS banner and torchrec's warnings included
    a = [json.loads(x)["step_loss"] for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x)["step_loss"] for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b, strict=True)), (a, b)


def test_plan_of_the_two_process_config_is_quiet():
    proc = gem_train("plan", "-c", str(ROOT / "configs" / "tiny-2proc.yaml"), "--nproc", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "planner torchrec_ddp: dp_replicate=2" in proc.stdout
    assert_quiet(proc)
