"""Loss spikes and skipped steps: structured warnings, in the log and in ``metrics.jsonl``.

A step's loss of at least ``trainer.loss_spike_factor`` times the running median of the previous
``trainer.loss_spike_window`` steps' losses is a spike: the run goes on, and rank 0 logs a warning
(logger ``gem_model.train``, the record in ``extra["gem_event"]``) and writes the same record as a
line of ``metrics.jsonl``::

    {"step": 31, "event": "loss_spike", "spike_loss": 41.2, "running_median": 0.69, "ratio": 59.7, "factor": 10.0, "window": 20}

A step whose update ``trainer.non_finite=skip`` skipped is recorded the same way, as the event
``non_finite_skip``. Steps are counted as the metrics count them, from 1.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("gem_model.train")

MIN_HISTORY = 3
"""Losses needed before the running median means anything: no spike is reported before them."""


@dataclass(frozen=True)
class LossSpike:
    step: int
    loss: float
    running_median: float
    factor: float
    window: int

    def record(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "event": "loss_spike",
            "spike_loss": self.loss,
            "running_median": self.running_median,
            "ratio": self.loss / self.running_median,
            "factor": self.factor,
            "window": self.window,
        }


class LossSpikes:
    """The running median of the last ``window`` finite losses, and the spikes above ``factor`` x it."""

    def __init__(self, factor: float | None, window: int):
        self.factor, self.window = factor, window
        self.losses: deque[float] = deque(maxlen=window)

    def observe(self, step: int, loss: float) -> LossSpike | None:
        """``step`` counted from 1; a spike is still added to the window (the median shrugs it off)."""
        spike = None
        if self.factor is not None and len(self.losses) >= MIN_HISTORY:
            median = statistics.median(self.losses)
            if median > 0 and loss >= self.factor * median:
                spike = LossSpike(step, loss, median, self.factor, self.window)
        self.losses.append(loss)
        return spike


def warn(name: str, record: dict[str, Any]) -> None:
    """Log one structured event (a spike or a skipped step) as a warning."""
    fields = " ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
    log.warning("[%s] warning: %s", name, fields, extra={"gem_event": record})
