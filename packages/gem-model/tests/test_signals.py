"""SIGTERM and SIGINT: the step in progress finishes, a checkpoint is written, the exit status is 128 + signum."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gem_model import testing
from gem_model.config_io import load_config
from gem_model.train.signals import EXIT_SIGINT, EXIT_SIGTERM
from gem_model.trainer import train

ENV = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "GEM_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1"}
SMALL = [
    *testing.INLINE_OVERRIDES, "trainer.log_every=1", "data.global_batch_size=8", "model.num_blocks=1",
    "data.source.options.max_len=15", "model.max_seq_len=16", "trainer.eval_at_end=false",
]  # fmt: skip


def records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def start(out: Path, *extra: str, steps: int = 100_000) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "gem_model", "run", *extra, *SMALL, f"trainer.steps={steps}", f"trainer.output_dir={out}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def logged(out: Path) -> int:
    """Complete metric lines so far (the run may be writing the next one)."""
    path = out / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def signal_after_steps(proc: subprocess.Popen[str], out: Path, signum: int, steps: int = 3) -> tuple[int, str]:
    """Wait (up to two minutes) until ``steps`` metric lines exist, send ``signum``, wait for the exit."""
    deadline = time.monotonic() + 120
    while logged(out) < steps:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run ended or stalled before step {steps}: {proc.communicate()[1][-3000:]}")
        time.sleep(0.02)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


def test_sigterm_finishes_the_step_writes_a_checkpoint_and_the_same_command_resumes(tmp_path, pm):
    out = tmp_path / "run"
    code, err = signal_after_steps(start(out), out, signal.SIGTERM)
    assert code == EXIT_SIGTERM == 143, err[-3000:]
    done = records(out)[-1]["step"]
    assert [r["step"] for r in records(out)] == list(range(1, done + 1))  # the last step was logged, once
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == [f"step_{done:08d}"], saved  # that step's checkpoint, complete (no .partial left)
    assert f"stopped by SIGTERM after step {done}" in err
    # the same command continues from that checkpoint, as if it had never stopped
    resumed = testing.run_until(
        [sys.executable, "-m", "gem_model", "run", *SMALL, f"trainer.steps={done + 2}", f"trainer.output_dir={out}"],
        env=ENV, timeout_s=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continuing from {out / 'checkpoints' / f'step_{done:08d}'} (step {done} of {done + 2})" in resumed.stdout
    losses = [r["step_loss"] for r in records(out)]
    assert [r["step"] for r in records(out)] == list(range(1, done + 3))
    straight = load_config(None, [*SMALL, f"trainer.steps={done + 2}", f"trainer.output_dir={tmp_path}/straight"])
    train(straight, pm)
    assert losses == [r["step_loss"] for r in records(tmp_path / "straight")]  # bitwise


def test_sigint_exits_130_after_the_checkpoint_even_when_none_was_configured(tmp_path):
    out = tmp_path / "run"
    code, err = signal_after_steps(start(out, "trainer.checkpoint_at_end=false"), out, signal.SIGINT)
    assert code == EXIT_SIGINT == 130, err[-3000:]
    done = records(out)[-1]["step"]
    assert (out / "checkpoints" / f"step_{done:08d}" / "manifest.json").is_file()
    assert "Traceback" not in err and f"stopped by SIGINT after step {done}" in err


@pytest.mark.multiprocess
def test_sigterm_to_every_process_of_a_torchrun_launch_stops_both_ranks_at_one_step(tmp_path):
    """As a scheduler does: the signal reaches torchrun and both ranks, each at its own moment."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gem_model", "run", "--nproc", "2", *SMALL, "parallel.planner=inline_replicated",
         "trainer.steps=100000", f"trainer.output_dir={out}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while logged(out) < 3:
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise AssertionError(proc.communicate()[1][-3000:])
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    done = records(out)[-1]["step"]
    assert err.count(f"stopped by SIGTERM after step {done}") + err.count(f"a peer's signal after step {done}") == 2, err[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{done:08d}"]
    assert proc.returncode != 0


def test_sigusr1_prints_every_threads_stack_and_the_run_goes_on(tmp_path):
    """``kill -USR1``: where the run is (the training loop in the main thread, the prefetch thread beside
    it), then more steps, then a SIGTERM stops it as usual."""
    out = tmp_path / "run"
    proc = start(out, "trainer.checkpoint_at_end=false", "trainer.prefetch=2")
    deadline = time.monotonic() + 120
    while logged(out) < 3:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run ended or stalled before step 3: {proc.communicate()[1][-3000:]}")
        time.sleep(0.02)
    proc.send_signal(signal.SIGUSR1)
    seen = logged(out)
    code, err = signal_after_steps(proc, out, signal.SIGTERM, steps=seen + 3)  # it went on training
    assert code == EXIT_SIGTERM, err[-3000:]
    assert "Current thread 0x" in err and err.count("Thread 0x") >= 1, err[-3000:]  # the main thread and another
    assert "(most recent call first)" in err and " in _loop" in err, err[-3000:]
