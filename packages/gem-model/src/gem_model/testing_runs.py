"""``gem-train run`` as a subprocess of a test, with a timeout that leaves the hung run's stacks in the failure.

A test that waits on a run with ``subprocess.run(..., timeout=600)`` learns nothing when the run hangs but
that it hung. Here, when the time is up, every process of the run's tree that trains (its command line is
``gem-train run``; torchrun's agent excluded, SIGUSR1 would end it) is sent SIGUSR1, which ``gem-train run``
answers by printing every thread's stack to stderr (:mod:`gem_model.train.stacks`); a few seconds later the
whole tree is killed and :class:`RunTimedOut` names the command and carries the tail of its stderr.
``gem-train run --nproc N`` replaces itself with torchrun (``os.execve``), so from then on its own process
shows torchrun's command line and only the ranks, torchrun's children, are signalled. Linux only (``/proc``).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from itertools import pairwise
from pathlib import Path

STACKS_WAIT_S = 3.0
"""How long the signalled processes get to write their stacks before the tree is killed."""
STACKS_GAP_S = 0.5
"""The pause between two processes' signals, so that their stacks come out one after the other (the ranks of a
torchrun launch share its stderr, and faulthandler writes a stack in many small pieces)."""
STDERR_TAIL = 30_000
"""How much of the end of stderr the failure message shows (the stacks of a few ranks fit)."""


class RunTimedOut(AssertionError):
    """A run outlived its timeout; the message has the signalled processes' stacks (stderr's tail)."""

    def __init__(self, cmd: Sequence[str], timeout_s: float, stdout: str, stderr: str, pids: list[int],
                 signalled: list[int]):  # fmt: skip
        self.cmd, self.timeout_s, self.stdout, self.stderr = list(cmd), timeout_s, stdout, stderr
        self.pids, self.signalled = pids, signalled
        super().__init__(f"{shlex.join(self.cmd)} timed out after {timeout_s} s and was killed (its processes: {pids}); "
                         f"the end of its stderr, with the stacks of its gem_model processes {signalled} (SIGUSR1):\n"
                         f"{stderr[-STDERR_TAIL:]}\n--- the end of its stdout:\n{stdout[-2000:]}")  # fmt: skip


def start_run(cmd: Sequence[str], *, env: Mapping[str, str], cwd: str | Path | None = None) -> subprocess.Popen[str]:
    """``cmd`` started in a session of its own (so that its whole tree can be killed), its output piped as text."""
    return subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env),
                            cwd=cwd, start_new_session=True)  # fmt: skip


def finish(proc: subprocess.Popen[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Wait up to ``timeout_s`` for ``proc`` (from :func:`start_run`), its pipes drained meanwhile: its
    CompletedProcess, or, past the timeout, :class:`RunTimedOut` once its tree is signalled and killed."""
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        pass
    tree = process_tree(proc.pid)
    signalled = [pid for pid in tree if trains(cmdline(pid))]
    for i, pid in enumerate(signalled):  # one at a time: ranks dumping together interleave their writes
        if i:
            try:
                proc.communicate(timeout=STACKS_GAP_S)
            except subprocess.TimeoutExpired:
                pass
        _signal(pid, signal.SIGUSR1)
    try:  # the stacks go to the pipes: keep draining them meanwhile (communicate keeps what it has read)
        proc.communicate(timeout=STACKS_WAIT_S if signalled else 0.01)
    except subprocess.TimeoutExpired:
        pass
    tree = sorted(set(tree) | set(process_tree(proc.pid)))
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # the group is gone already
        pass
    for pid in tree:  # also any that left the group (setsid)
        _signal(pid, signal.SIGKILL)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # a process the walk missed holds the pipes open
        out, err = "", "(no output: the pipes stayed open 30 s after the kill)"
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    args = proc.args if isinstance(proc.args, list) else [str(proc.args)]
    raise RunTimedOut(args, timeout_s, out, err, tree, signalled)


def run_until(
    cmd: Sequence[str], *, env: Mapping[str, str], timeout_s: float, cwd: str | Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(cmd, capture_output=True, text=True, ...)`` whose timeout raises :class:`RunTimedOut`
    with the stacks of the run's processes (see the module doc) instead of ``TimeoutExpired``."""
    return finish(start_run(cmd, env=env, cwd=cwd), timeout_s)


def process_tree(root: int) -> list[int]:
    """``root`` and every process descending from it, by the parent pids of ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:  # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ")"
            ppid = int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(ppid, []).append(int(name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return sorted(found)


def cmdline(pid: int) -> list[str]:
    """The arguments ``pid`` runs with (none once it is gone or a zombie)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def trains(args: list[str]) -> bool:
    """Whether a process of these arguments is ``gem-train run`` (``-m gem_model run``, as torchrun starts each
    rank, or the script), which prints its stacks on SIGUSR1, and not torchrun (whose command names it too)."""
    runs = any(a == "-m" and b == "gem_model" and c == "run" for a, b, c in zip(args, args[1:], args[2:]))
    script = any(os.path.basename(a) == "gem-train" and b == "run" for a, b in pairwise(args))
    torchrun = "torch.distributed.run" in args or any(os.path.basename(a) == "torchrun" for a in args)
    return (runs or script) and not torchrun


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (killed, but not yet reaped by its parent)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:  # gone meanwhile
        pass
