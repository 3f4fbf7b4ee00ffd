"""Where a hung run is: ``kill -USR1 <pid>`` prints every thread's Python stack to the process's stderr.

A rank waiting in a collective for a stalled peer, a data source that stopped delivering, a deadlock:
each looks the same from outside, a process that no longer logs. ``gem-train run`` registers SIGUSR1
with :mod:`faulthandler` in every process it trains in, so the stacks are one signal away, with no
debugger attached and nothing stopped: the run goes on after printing them. Under torchrun, signal the
ranks, not the agent (whose SIGUSR1 would end it): ``pkill -USR1 -P <torchrun's pid>``.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

STACKS_SIGNAL: signal.Signals | None = getattr(signal, "SIGUSR1", None)
"""The signal that prints the stacks (None where the platform has no SIGUSR1)."""


def print_stacks_on_signal() -> bool:
    """Register :data:`STACKS_SIGNAL`: on it, every thread's stack goes to the process's stderr (its file
    descriptor, also where ``sys.stderr`` was replaced in the process, as by a caller capturing it) and the
    process runs on. Returns whether it could be registered."""
    stream = sys.__stderr__
    if STACKS_SIGNAL is None or stream is None:
        return False
    try:
        faulthandler.register(STACKS_SIGNAL, file=stream, all_threads=True, chain=False)
    except (OSError, ValueError):  # a stderr without a file descriptor (io.UnsupportedOperation is both)
        return False
    return True
