"""The README's commands on the installed packages: plugins, the default run, two processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def gem_train(*args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GEM_DISABLE_PLUGIN_AUTOLOAD", None)
    return subprocess.run([sys.executable, "-m", "gem_model", *args], capture_output=True, text=True, env=env, timeout=timeout)


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
    assert "Warning" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr  # nothing a user cannot act on
    records = [json.loads(x) for x in (tmp_path / "gem-tiny" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"]


def test_the_main_command_twice_in_a_row(tmp_path):
    args = ("run", "trainer.steps=6", f"trainer.output_dir={tmp_path}/{{name}}")
    first = gem_train(*args)
    assert first.returncode == 0, first.stderr[-3000:]
    second = gem_train(*args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "nothing to train" in second.stdout and "step 6 of trainer.steps=6" in second.stdout
    assert "Warning" not in second.stdout + second.stderr
    assert len((tmp_path / "gem-tiny" / "metrics.jsonl").read_text().splitlines()) == 1  # log_every 10: step 6 only


@pytest.mark.multiprocess
def test_two_processes_with_the_real_plugins(tmp_path):
    common = ["trainer.steps=4", "trainer.log_every=1", "data.global_batch_size=16", "trainer.checkpoint_at_end=false"]
    one = gem_train("run", *common, f"trainer.output_dir={tmp_path}/one")
    two = gem_train("run", "--nproc", "2", "parallel.planner=torchrec_ddp", *common, f"trainer.output_dir={tmp_path}/two")
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    a = [json.loads(x)["step_loss"] for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x)["step_loss"] for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b, strict=True)), (a, b)
