"""Timing helpers shared by the micro-benchmarks: calls timed alone with CUDA events, the variants in
rotated order round after round (so that none always runs first or after the same one), and the JSON
result with its date, device and command."""

from __future__ import annotations

import datetime
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from profiling import timed_ms  # benchmarks/profiling.py, beside this script


def _rotated(fns: dict[str, Callable[[], object]], rounds: int,
             measure: Callable[[Callable[[], object]], float]) -> dict[str, list[float]]:  # fmt: skip
    """``measure(fn)`` of each variant over ``rounds`` rounds in rotated order, after one warm-up call each."""
    names = list(fns)
    for name in names:
        fns[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            times[name].append(measure(fns[name]))
    return times


def rotated_rounds(fns: dict[str, Callable[[], object]], rounds: int) -> dict[str, list[float]]:
    """Milliseconds of each call of each variant over ``rounds`` rounds, after one warm-up call each."""
    return _rotated(fns, rounds, timed_ms)


def queued_device_ms(fn: Callable[[], object], iters: int, sleep_cycles: int) -> float:
    """Device milliseconds a call of ``fn``, ``iters`` calls queued behind a ``torch.cuda._sleep`` that
    holds the device while the host launches them: the host's launch time, which a training step hides
    behind the device's work, is not counted."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(sleep_cycles)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def rotated_queued_rounds(fns: dict[str, Callable[[], object]], rounds: int, iters: int,
                          sleep_cycles: int) -> dict[str, list[float]]:  # fmt: skip
    """:func:`queued_device_ms` of each variant over ``rounds`` rounds in rotated order, after one warm-up
    call each."""
    return _rotated(fns, rounds, lambda fn: queued_device_ms(fn, iters, sleep_cycles))


def spread(ms: list[float]) -> dict[str, Any]:
    """``{"median", "q1", "q3", "ms"}`` of one variant's timings (inclusive quartiles), and the cell that
    prints them: ``"median (q1-q3)"``."""
    q = statistics.quantiles(ms, n=4, method="inclusive")
    return {"median": statistics.median(ms), "q1": q[0], "q3": q[2], "ms": ms}


def cell(stats: dict[str, Any]) -> str:
    return f"{stats['median']:.3f} ({stats['q1']:.3f}-{stats['q3']:.3f})"


def save_results(path: str | None, results: list[dict], **meta: Any) -> None:
    """``{"meta": {date, device, torch, command, **meta}, "results": results}`` into ``path`` (if given)."""
    if not path:
        return
    head = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv)}  # fmt: skip
    Path(path).write_text(json.dumps({"meta": {**head, **meta}, "results": results}, indent=1))
