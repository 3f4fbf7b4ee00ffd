"""A time limit for one profile section (``gem-train profile --section-budget SECONDS``).

A section is cut off by ``SIGALRM``: the handler raises :class:`SectionTimeout` in the main thread at
the next Python bytecode, so the section unwinds (its tensors are freed) and the profile goes on with
the next one. A kernel already running finishes first: the limit is as fine as the section's longest
single call. It needs the main thread of a POSIX process, which ``gem-train profile`` (and each rank
under ``torchrun``) is.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

from gem_model.errors import ConfigError


class SectionTimeout(BaseException):
    """A section ran past its budget. A ``BaseException``, like ``KeyboardInterrupt``, so that a
    section's own ``except Exception`` (a candidate that failed, a scheme that cannot run) does not
    swallow it."""


def check_can_limit(seconds: float | None) -> None:
    """Refuse a budget this process cannot enforce, before any section runs."""
    if seconds is None:
        return
    if not seconds > 0:
        raise ConfigError([("--section-budget", seconds, "must be a number of seconds > 0")])
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        raise ConfigError([("--section-budget", seconds, "needs the main thread of a POSIX process (it cuts "
                            "a section off with SIGALRM)")])  # fmt: skip


@contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Raise :class:`SectionTimeout` inside the block once it has run ``seconds`` (None: no limit)."""
    if seconds is None:
        yield
        return
    check_can_limit(seconds)

    def fire(signum: int, frame: FrameType | None) -> None:
        raise SectionTimeout(f"{what} ran past its budget of {seconds:g} s (--section-budget)")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
