"""The prefetching loader: built ahead while the step runs, in step order, failures at their step, clean stop.

No test here decides anything by timing: the slow source sleeps so that the overlap is real, but the
assertions are on the order of events and on whether a batch was built before it was asked for.
"""

from __future__ import annotations

import json
import threading
import traceback

import pytest
import torch

from gem_model.config_io import load_config
from gem_model.data.balance import RoundRobinBalancer
from gem_model.data.batch import Batch
from gem_model.data.loader import ShardedLoader
from gem_model.data.prefetch import PrefetchLoader, SyncFeed, batch_tensors, make_feed
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.trainer import train

WAIT = 30.0  # seconds an event may take before the test fails: generous, it only bounds a hang


class SlowSource(SyntheticSource):
    """Sleeps in every ``make_batch`` and records when each build starts and ends; may fail at a step."""

    name = "slow"

    def __init__(self, config: SyntheticConfig | None = None, *, delay: float = 0.2, fail_at: int | None = None):
        super().__init__(config)
        self.delay, self.fail_at = delay, fail_at
        self.events: list[str] = []
        self._flags: dict[tuple[str, int], threading.Event] = {}
        self._lock = threading.Lock()

    def flag(self, what: str, step: int) -> threading.Event:
        with self._lock:
            return self._flags.setdefault((what, step), threading.Event())

    def started(self, step: int) -> threading.Event:
        return self.flag("started", step)

    def done(self, step: int) -> threading.Event:
        return self.flag("done", step)

    def make_batch(self, step: int, global_batch_size: int, indices: torch.Tensor) -> Batch:
        self.events.append(f"build {step}")
        self.started(step).set()
        threading.Event().wait(self.delay)
        if step == self.fail_at:
            raise ValueError(f"the source broke at step {step}")
        batch = super().make_batch(step, global_batch_size, indices)
        self.events.append(f"built {step}")
        self.done(step).set()
        return batch


def sharded(source: SyntheticSource | None = None, b: int = 8) -> ShardedLoader:
    return ShardedLoader(
        source or SyntheticSource(SyntheticConfig(max_len=15)), RoundRobinBalancer(), global_batch_size=b
    )


def same(x: Batch, y: Batch) -> bool:
    return all(torch.equal(a, b) for a, b in zip(batch_tensors(x), batch_tensors(y), strict=True))


def test_the_next_batch_is_built_while_the_step_runs():
    source = SlowSource(SyntheticConfig(max_len=15))
    with PrefetchLoader(sharded(source), depth=2) as feed:
        first = next(feed)
        assert first.step == 0 and first.waited  # nothing could be ready before the first ask
        source.events.append("step 0 runs")
        # The simulated step's other work ends once the thread has begun step 2, which it does only
        # after handing over step 1: only a thread working while the step runs gets there.
        assert source.started(2).wait(WAIT), "step 1 was not built while step 0 ran"
        source.events.append("step 0 ends")
        second = next(feed)
        assert second.step == 1 and not second.waited  # ready before it was asked for
        assert source.events.index("build 1") < source.events.index("step 0 ends")
        assert feed.waits == 1


def test_without_prefetching_the_step_builds_its_own_batch():
    source = SlowSource(SyntheticConfig(max_len=15), delay=0.0)
    feed = SyncFeed(sharded(source))
    source.events.append("ask 0")
    assert next(feed).waited and source.events == ["ask 0", "build 0", "built 0"]


def test_batches_are_a_function_of_the_step_whatever_the_depth_and_start():
    reference = sharded()
    for depth in (1, 2, 3):
        with PrefetchLoader(sharded(), depth=depth) as feed:
            assert all(same(next(feed).ready(), reference.batch_at(s)) for s in range(5))
            # asked out of order (a seek): the thread restarts there
            assert same(feed.get(9).ready(), reference.batch_at(9)) and feed.get(10).step == 10


def test_resume_from_a_state_dict_continues_exactly():
    with PrefetchLoader(sharded(), depth=2) as a:
        for _ in range(3):
            next(a)
        state = a.state_dict()
        expected = [next(a).ready() for _ in range(3)]
    assert state["step"] == 3
    with PrefetchLoader(sharded(), depth=2) as b:
        next(b)  # b's thread is already ahead at step 1 ...
        b.load_state_dict(state)  # ... and restarts at 3
        assert b.step == 3 and all(same(next(b).ready(), e) for e in expected)


def test_a_failure_in_the_thread_surfaces_at_its_step_with_its_traceback():
    source = SlowSource(SyntheticConfig(max_len=15), delay=0.0, fail_at=3)
    with PrefetchLoader(sharded(source), depth=4) as feed:
        assert [next(feed).step for _ in range(3)] == [0, 1, 2]  # the thread failed ahead; these are fine
        with pytest.raises(ValueError, match="the source broke at step 3") as err:
            next(feed)
        assert "building the batch of step 3" in "".join(err.value.__notes__)
        assert "make_batch" in [frame.name for frame in traceback.extract_tb(err.value.__traceback__)]
        assert feed.thread is None  # stopped, nothing left running


def test_close_joins_the_thread_also_when_it_waits_on_a_full_queue():
    feed = PrefetchLoader(sharded(), depth=1)
    next(feed)
    thread = feed.thread
    assert thread is not None and thread.is_alive()  # blocked: its one slot is full
    feed.close()
    assert not thread.is_alive() and feed.thread is None
    feed.close()  # idempotent


def test_an_exception_in_the_consumer_stops_the_thread():
    feed = PrefetchLoader(sharded(), depth=2)
    with pytest.raises(RuntimeError, match="the step failed"), feed:
        next(feed)
        raise RuntimeError("the step failed")
    assert feed.thread is None


def test_no_batch_is_built_past_the_end():
    source = SlowSource(SyntheticConfig(max_len=15), delay=0.0)
    with PrefetchLoader(sharded(source), depth=3, end=2) as feed:
        assert [next(feed).step for _ in range(2)] == [0, 1]
        with pytest.raises(IndexError, match="past the last step"):
            next(feed)
    assert "build 2" not in source.events


def test_exclusive_keeps_the_thread_away_from_the_source():
    source = SlowSource(SyntheticConfig(max_len=15), delay=0.01)
    with PrefetchLoader(sharded(source), depth=3) as feed:
        next(feed)  # the thread now builds steps 1 to 3
        with feed.exclusive():  # waits for a build in progress, then holds the thread off
            before = list(source.events)
            threading.Event().wait(0.1)  # a chance to misbehave; no outcome depends on its length
            assert source.events == before and (not before or before[-1].startswith("built"))
        assert source.done(3).wait(WAIT)


def test_make_feed_picks_by_depth():
    assert type(make_feed(sharded(), prefetch=0, device=torch.device("cpu"), facts=lambda b: None)) is SyncFeed
    feed = make_feed(sharded(), prefetch=3, device=torch.device("cpu"), facts=lambda b: None)
    assert isinstance(feed, PrefetchLoader) and feed.depth == 3


def step_losses(path) -> list[float]:
    return [json.loads(line)["step_loss"] for line in (path / "metrics.jsonl").read_text().splitlines()]


def test_prefetching_leaves_the_losses_bitwise_unchanged(pm, tiny_overrides, tmp_path):
    common = [*tiny_overrides, "model.dropout=0.2", "trainer.steps=5"]
    train(load_config(None, [*common, "trainer.prefetch=0", f"trainer.output_dir={tmp_path}/off"]), pm)
    train(load_config(None, [*common, "trainer.prefetch=2", f"trainer.output_dir={tmp_path}/on"]), pm)
    off, on = step_losses(tmp_path / "off"), step_losses(tmp_path / "on")
    assert len(off) == 5 and off == on
    assert not [t for t in threading.enumerate() if t.name.startswith("gem-prefetch")]
