"""``gem_model.testing_runs``: a run that outlives its timeout fails with its ranks' stacks, and leaves no process."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from gem_model import testing
from gem_model.testing_runs import alive, process_tree, trains

ENV = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "GEM_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1"}


def test_a_command_that_ends_in_time_gives_its_completed_process_unchanged():
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    proc = testing.run_until([sys.executable, "-c", code], env=ENV, timeout_s=60)
    assert (proc.args, proc.returncode, proc.stdout, proc.stderr) == ([sys.executable, "-c", code], 3, "out\n", "err\n")


def test_the_ranks_are_signalled_and_the_agent_is_not():
    py = sys.executable
    assert trains([py, "-u", "-m", "gem_model", "run", "trainer.steps=4"])  # a rank, as torchrun starts it
    assert trains([py, "/venv/bin/gem-train", "run"])
    assert trains([py, "-m", "gem_model", "run", "--nproc", "2"])  # the launcher, before it becomes torchrun
    assert not trains([py, "-m", "torch.distributed.run", "--nproc-per-node=2", "-m", "gem_model", "run"])
    assert not trains([py, "-c", "import gem_model"])
    assert not trains([py, "-m", "gem_model", "profile"])  # only ``run`` prints its stacks on SIGUSR1


def test_a_timeout_kills_the_whole_tree_grandchildren_too():
    with pytest.raises(testing.RunTimedOut, match=r"sh -c 'sleep 60 & sleep 60' timed out after 0.5 s") as caught:
        testing.run_until(["sh", "-c", "sleep 60 & sleep 60"], env=ENV, timeout_s=0.5)
    assert len(caught.value.pids) >= 2  # the shell (or the sleep it became) and the one in the background
    assert not [pid for pid in caught.value.pids if alive(pid)]


@pytest.mark.multiprocess
def test_a_hung_two_process_run_fails_with_both_ranks_stacks_and_leaves_no_process(tmp_path: Path):
    """A run far longer than its timeout stands for a hung one: once it has logged a step (both ranks in
    the training loop), the timeout passes, and the failure shows where each rank was."""
    out = tmp_path / "run"
    args = [*testing.INLINE_OVERRIDES, "parallel.planner=inline_replicated", "trainer.checkpoint_at_end=false"]
    cmd = [sys.executable, "-m", "gem_model", "run", "--nproc", "2", *args, "trainer.steps=1000000",
           f"trainer.output_dir={out}"]  # fmt: skip
    proc = testing.start_run(cmd, env=ENV)
    deadline = time.monotonic() + 60
    metrics = out / "metrics.jsonl"
    while not (metrics.exists() and metrics.read_text().count("\n")) and proc.poll() is None:
        if time.monotonic() > deadline:
            break  # finish below times out all the same and shows where the ranks were
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-3000:]  # it ended: no hang to look at
    recorded = process_tree(proc.pid)
    assert len(recorded) >= 3, recorded  # torchrun (in the launcher's process) and its two ranks
    with pytest.raises(testing.RunTimedOut) as caught:
        testing.finish(proc, timeout_s=1)
    message = str(caught.value)
    assert "--nproc 2" in message and "timed out after 1 s" in message
    assert len(caught.value.signalled) == 2 and proc.pid not in caught.value.signalled  # the ranks, not torchrun
    assert message.count("Current thread 0x") == 2, message  # one per rank
    assert "Thread 0x" in message and 'File "' in message
    # both in the training loop: the function's name is one write of faulthandler's, whole even where two
    # ranks' dumps interleave (the signals go out 0.5 s apart, but a loaded machine may stall a rank longer)
    assert message.count("_loop") >= 2, message
    assert not [pid for pid in {*recorded, *caught.value.pids} if alive(pid)]
