"""Python's garbage collection at step boundaries (``trainer.gc_every``).

Left to itself, the cyclic collector runs whenever allocations trip its thresholds: inside a step, at
any Python line. A full collection walks every tracked object, and a run holds millions of them (the
model, torchrec's sharded modules, the plugin manager), so such a pause takes milliseconds. Where the
device waits for the host (right after the step's loss sync, which empties the device's queue) the
pause is device idle time. With ``every = N``:

- at the start, one full collection, then :func:`gc.freeze`: what the set-up built is moved to the
  permanent generation, which later collections do not walk;
- during the loop, automatic collection off, and a collection after every N-th step, between steps,
  where the host pause costs the least: it walks only what was made since the freeze, so it is short;
- at the end (also when a step raised), the frozen objects back into the collected generations,
  automatic collection back as it was, and one full collection, so that nothing waits past the loop.

``every = 0`` leaves Python's own collection as it is.
"""

from __future__ import annotations

import gc
from types import TracebackType


class GcSchedule:
    """Around a training loop: :meth:`start` before it, :meth:`after_step` after each step, :meth:`stop`
    after it (also when it raised); or use it as a context manager."""

    def __init__(self, every: int):
        if every < 0:
            raise ValueError(f"trainer.gc_every must be >= 0 (0: Python's own collection), got {every}")
        self.every = every
        self.collections = 0
        """Scheduled collections so far (not counting the ones at entry and exit)."""
        self._was_enabled = True
        self._active = False

    def start(self) -> GcSchedule:
        if self.every and not self._active:
            self._was_enabled = gc.isenabled()
            gc.collect()
            gc.freeze()
            gc.disable()
            self._active = True
        return self

    def after_step(self, step: int) -> None:
        """``step`` counts from 0; collects after every ``every``-th step."""
        if self._active and (step + 1) % self.every == 0:
            gc.collect()
            self.collections += 1

    def stop(self) -> None:
        if not self._active:
            return
        self._active = False
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
        gc.collect()

    def __enter__(self) -> GcSchedule:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
