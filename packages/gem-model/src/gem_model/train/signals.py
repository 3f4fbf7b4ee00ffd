"""SIGTERM and SIGINT during training: finish the step in progress, checkpoint, then exit.

A scheduler's SIGTERM (Slurm, Kubernetes, torchrun passing one on) or a Ctrl-C only sets a flag.
The flag travels in the step's one all-reduce (:class:`~gem_model.train.step.CoreStep`), so every
rank stops after the same step even when the signal reached them at different moments; the run
then writes a checkpoint and raises :class:`~gem_model.errors.RunInterrupted`, and ``gem-train``
exits ``128 + signum``: 143 after SIGTERM, 130 after SIGINT. A second signal of either kind while
the run winds down is not caught again: the process then ends as it would have without us.

With ``trainer.stop_grace_s`` set, a rank that has not wound down that many seconds after the
signal exits at once, ``128 + signum``, without a checkpoint: a rank stalled inside its step
(torchrun sends SIGTERM to the survivors when a peer fails) must not outlive its peers by
torchrun's whole shutdown grace.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_SIGTERM = 128 + int(signal.SIGTERM)  # 143
EXIT_SIGINT = 128 + int(signal.SIGINT)  # 130


class StopRequest:
    """Which signal asked the run to stop, if any (set by the handler, read by the step)."""

    def __init__(self, grace_s: float | None = None) -> None:
        self.signum: int | None = None
        self.grace_s = grace_s
        self._deadline: threading.Timer | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def set(self, signum: int) -> None:
        """The first signal: stop after the step; with ``grace_s``, exit at once if that takes longer."""
        self.signum = signum
        if self.grace_s is not None:
            self._deadline = threading.Timer(self.grace_s, _out_of_grace, args=(signum, self.grace_s))
            self._deadline.daemon = True
            self._deadline.start()

    def wound_down(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()


def _out_of_grace(signum: int, grace_s: float) -> None:
    print(
        f"gem-train: {signal.Signals(signum).name} {grace_s:g} s ago (trainer.stop_grace_s) and the step in progress "
        "has not finished (a stalled step?): exiting without a checkpoint",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + signum)


@contextlib.contextmanager
def stop_on_signals(request: StopRequest) -> Iterator[StopRequest]:
    """While inside, SIGTERM and SIGINT set ``request`` instead of ending the process.

    Signal handlers can only be installed from the main thread; elsewhere (a run inside a worker
    thread) nothing is installed and the signals keep their usual effect.
    """
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous: dict[int, Any] = {s: signal.getsignal(s) for s in SIGNALS}

    def handle(signum: int, frame: FrameType | None) -> None:
        if request.signum is None:
            request.set(signum)
            return
        for s, handler in previous.items():  # the second signal: no more grace
            signal.signal(s, handler)
        signal.raise_signal(signum)

    for s in SIGNALS:
        signal.signal(s, handle)
    try:
        yield request
    finally:
        request.wound_down()
        for s, handler in previous.items():
            signal.signal(s, handler)
