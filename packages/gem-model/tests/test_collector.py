"""``trainer.gc_every``: Python's cyclic collector at step boundaries (gem_model.train.collector)."""

from __future__ import annotations

import gc
import weakref

import pytest

from gem_model.config import TrainerConfig
from gem_model.train.collector import GcSchedule


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


@pytest.fixture
def collections() -> list[int]:
    """The generation of every collection that runs while the test does."""
    seen: list[int] = []

    def hook(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(hook)
    yield seen
    gc.callbacks.remove(hook)


def test_collects_between_steps_only(collections: list[int]) -> None:
    schedule = GcSchedule(3)
    with schedule:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        collections.clear()  # the one at entry
        garbage = []
        for step in range(7):
            node = Node()
            garbage.append(weakref.ref(node))
            del node
            for _ in range(20_000):  # far past the thresholds that would trigger automatic collections
                Node()
            schedule.after_step(step)
            if step == 1:
                assert collections == [] and garbage[0]() is not None  # no collection inside the first steps
            if step == 2:
                assert collections == [2] and all(r() is None for r in garbage)  # the third step's collection
    assert schedule.collections == 2  # after steps 3 and 6
    assert gc.isenabled() and gc.get_freeze_count() == 0
    assert all(r() is None for r in garbage)


def test_restores_the_collector_when_the_loop_raises() -> None:
    schedule = GcSchedule(5)
    with pytest.raises(RuntimeError, match="a step failed"):
        with schedule:
            schedule.after_step(0)
            raise RuntimeError("a step failed")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_keeps_a_disabled_collector_disabled() -> None:
    gc.disable()
    try:
        with GcSchedule(2):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_zero_leaves_python_alone(collections: list[int]) -> None:
    schedule = GcSchedule(0)
    with schedule:
        assert gc.isenabled() and gc.get_freeze_count() == 0
        for step in range(3):
            schedule.after_step(step)
    assert schedule.collections == 0 and collections == []


def test_the_config_field() -> None:
    assert TrainerConfig().gc_every == 0
    assert TrainerConfig(gc_every=50).gc_every == 50
    with pytest.raises(ValueError, match="gc_every"):
        TrainerConfig(gc_every=-1)
    with pytest.raises(ValueError, match="gc_every must be >= 0"):
        GcSchedule(-1)
