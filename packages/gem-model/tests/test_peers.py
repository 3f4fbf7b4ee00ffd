"""A stalled or dead peer: every rank exits non-zero, the error names the collective and the rank,
no process is left behind. Ranks that read different data are stopped before the first step, and so
are all ranks when rank 0 finds the output directory held by another run. (A peer SIGKILLed and
restarted by torchrun: ``test_elastic.py``.)

2 processes through torchrun, the fault from the ``inline_fault`` callback (rank 1, in step 3).
The stalled case runs with ``trainer.collective_timeout_s=3`` and ``trainer.stop_grace_s=3``: rank 0
gives up waiting after 3 s, torchrun sends the stalled rank SIGTERM, and 3 s later it exits. The
promise is "within the collective timeout plus 30 s" (torchrun's SIGKILL comes 30 s after its
SIGTERM when no stop_grace_s is set); the bound asserted adds the start-up of two processes on a
loaded 2-core machine. The dead peer leaves with ``os._exit(1)`` in step 3 (no handler runs, no
process group is torn down) and no stop_grace_s is set: rank 0's collective fails at once, long
before any timeout.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gem_model import testing

pytestmark = pytest.mark.multiprocess

ENV = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "GEM_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1"}
RUN = [*testing.INLINE_OVERRIDES, "parallel.planner=inline_replicated", "data.global_batch_size=8", "trainer.steps=50"]
TIMEOUT_S, GRACE_S, START_UP_S = 3, 3, 90


# Loaded by every process of a launch through PYTHONPATH: at exit (atexit runs before the interpreter
# tears down), each process names its native threads, so a process group left alive is seen.
THREADS_AT_EXIT = """
import atexit, os, sys

def _threads_at_exit():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    line = f"threads at exit of rank {os.environ.get('RANK', '-')}: {','.join(sorted(names))}\\n"
    sys.stderr.flush()
    os.write(2, line.encode())  # one write: the ranks' lines do not interleave on the shared stderr

atexit.register(_threads_at_exit)
"""


SURVIVOR_WINDOW = {"PET_MONITOR_INTERVAL": "2"}
"""torchrun's agent looks at its workers every 0.1 s by default and stops the group as soon as one is
dead, so the survivor may be stopped before its collective sees the dead peer and says so (seen once in
the fresh-clone check of 2026-12-06, as in test_elastic.py): looking every 2 s leaves it that time."""


def launch(out: Path, *extra: str, site: Path | None = None,
           env_extra: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:  # fmt: skip
    """``site``: a folder whose ``sitecustomize.py`` every process imports; ``env_extra``: more environment."""
    cmd = [sys.executable, "-m", "gem_model", "run", "--nproc", "2", *RUN, *extra, f"trainer.output_dir={out}"]
    env = ENV if site is None else {**ENV, "PYTHONPATH": os.pathsep.join([str(site), ENV.get("PYTHONPATH", "")])}
    env = {**env, **(env_extra or {})}
    start = time.monotonic()
    proc = testing.run_until(cmd, env=env, timeout_s=300)  # a hang fails with the ranks' stacks
    return proc, time.monotonic() - start


def left_behind(out: Path) -> list[str]:
    """Processes still running whose command line names this test's output directory."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(out) in cmdline:
            found.append(f"{pid}: {cmdline[:200]}")
    return found


def fault(kind: str) -> str:
    return f"callbacks=[{{name: inline_fault, options: {{rank: 1, at_step: 3, fault: {kind}, every_attempt: true}}}}]"


def test_a_stalled_peer_stops_every_rank_within_the_collective_timeout(tmp_path):
    out = tmp_path / "stalled"
    proc, seconds = launch(out, fault("stall"), f"trainer.collective_timeout_s={TIMEOUT_S}", f"trainer.stop_grace_s={GRACE_S}")
    assert proc.returncode != 0
    assert "inline_fault: stall rank 1 in step 3" in proc.stderr
    message = "PeerError: rank 0: the collective all_reduce of the stop flags (step 3, all ranks) failed: a peer died"
    assert message in proc.stderr and f"trainer.collective_timeout_s={TIMEOUT_S} s" in proc.stderr, proc.stderr[-3000:]
    assert f"SIGTERM {GRACE_S} s ago (trainer.stop_grace_s)" in proc.stderr  # the stalled rank, on its own
    assert not left_behind(out)
    assert seconds < TIMEOUT_S + GRACE_S + START_UP_S


def test_a_dead_peer_stops_every_rank_at_once_naming_the_collective(tmp_path):
    out = tmp_path / "dead"
    proc, seconds = launch(out, fault("exit"), f"trainer.collective_timeout_s={TIMEOUT_S * 20}", env_extra=SURVIVOR_WINDOW)
    assert proc.returncode != 0
    assert "inline_fault: exit rank 1 in step 3" in proc.stderr
    message = "PeerError: rank 0: the collective all_reduce of the stop flags (step 3, all ranks) failed: a peer died"
    assert message in proc.stderr, proc.stderr[-3000:]
    assert "local_rank: 1" in proc.stderr and "exitcode: 1" in proc.stderr  # torchrun saw rank 1 die
    assert not left_behind(out)
    assert seconds < TIMEOUT_S * 20 + START_UP_S  # the peer's death fails the collective, no timeout waited out


def test_ranks_reading_different_data_are_stopped_before_the_first_step(tmp_path):
    out = tmp_path / "uneven"
    proc, _ = launch(out, "data.source=inline_uneven", "data.source.options.max_len=15")
    assert proc.returncode != 0
    assert "the ranks read different data (data.source 'inline_uneven', global batch 8), found before step 1" in proc.stderr
    assert "rank 0: 10 steps per epoch" in proc.stderr and "rank 1: 9 steps per epoch" in proc.stderr
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()
    assert not left_behind(out)


def test_every_rank_stops_with_exit_2_when_rank_0_cannot_lock_the_output_directory(tmp_path):
    """The directory is held by a shared lock here, which the ranks' own checks (shared too) pass
    but rank 0's exclusive lock does not: rank 1 learns of the refusal in the start-up all-reduce.
    Neither rank keeps the process group past its teardown: a gloo group alive at exit aborts the
    process (SIGABRT) in about one start in ten, so its threads are looked for at every exit."""
    out = tmp_path / "held"
    out.mkdir()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(THREADS_AT_EXIT)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "started": "2026-12-02T00:00:00+00:00"}
    (out / "run.lock").write_text(json.dumps(holder))
    fd = os.open(out / "run.lock", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    try:
        proc, _ = launch(out, site=site)
    finally:
        os.close(fd)
    exits = [line for line in proc.stderr.splitlines() if line.startswith("threads at exit of rank")]
    assert sorted(line.split(":")[0] for line in exits)[-2:] == ["threads at exit of rank 0", "threads at exit of rank 1"], exits
    assert not [line for line in exits if "gloo" in line], exits  # the group's threads were joined by its teardown
    refusal = f"trainer.output_dir: is in use by another run: pid {os.getpid()} on host {socket.gethostname()}"
    assert proc.returncode != 0 and proc.stderr.count(refusal) == 2, proc.stderr[-3000:]  # both ranks say it
    assert "exitcode: 2" in proc.stderr and "SIGABRT" not in proc.stderr, proc.stderr[-3000:]  # no rank aborted on the way out
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    assert not left_behind(out)


def test_a_finished_run_leaves_no_gloo_thread_to_the_interpreters_exit(tmp_path):
    """The planner's and comm strategy's objects hold the run's groups in reference cycles; left to the
    interpreter's exit, a gloo group's threads are torn down with it, which aborts a rank now and then
    (SIGABRT after a run that succeeded). ``gem-train run`` frees them after its teardown."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(THREADS_AT_EXIT)
    proc, _ = launch(tmp_path / "done", "trainer.steps=2", site=site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exits = [line for line in proc.stderr.splitlines() if line.startswith("threads at exit of rank")]
    assert sorted(line.split(":")[0] for line in exits)[-2:] == ["threads at exit of rank 0", "threads at exit of rank 1"], exits
    assert not [line for line in exits if "gloo" in line], exits
