"""Live progress on rank 0: a rich display on a terminal, one line per log interval otherwise.

On a terminal (stderr is a TTY) long work shows a rich progress display: what runs, a bar, done of
total, the rate, the time left and, for training, the current loss and throughput. Elsewhere (CI,
a log file) training prints the plain line of each log interval, and other work prints nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.table import Column
from rich.text import Text


class RateColumn(ProgressColumn):
    """Units per second over rich's recent-update window (``-`` until there are two updates)."""

    def render(self, task: Task) -> Text:
        unit = task.fields.get("unit", "it")
        return Text("-" if task.speed is None else f"{task.speed:,.2f} {unit}/s")


def _fixed() -> Column:
    return Column(no_wrap=True)


WIDE = 130
"""Columns from which the display shows the bar and the elapsed time too."""


def live_display(console: Console | None = None) -> RichProgress:
    """The rich display every kind of long work uses (``console``: stderr by default).

    The columns before the last keep their width; the last (the current loss and throughput, the
    most telling first) is cut on a narrow terminal. Below :data:`WIDE` columns the bar and the
    elapsed time make room for it, so that an 80-column terminal still shows tokens/s and MFU.
    """
    console = console if console is not None else Console(file=sys.stderr)
    wide = console.width >= WIDE
    columns: list[ProgressColumn] = [TextColumn("[bold]{task.description}", table_column=_fixed())]
    if wide:
        columns.append(BarColumn(bar_width=16, table_column=_fixed()))
    columns += [MofNCompleteColumn(table_column=_fixed()), RateColumn(table_column=_fixed())]
    if wide:
        columns.append(TimeElapsedColumn(table_column=_fixed()))
    columns += [
        TextColumn("ETA", table_column=_fixed()),
        TimeRemainingColumn(compact=True, table_column=_fixed()),
        TextColumn("{task.fields[info]}", table_column=Column(no_wrap=True, overflow="ellipsis", ratio=1)),
    ]
    return RichProgress(*columns, console=console, refresh_per_second=4, expand=True)


_SHOWN: ContextVar[bool] = ContextVar("gem_live_progress", default=True)


@contextmanager
def live_progress(enabled: bool) -> Iterator[None]:
    """Within it, :func:`task_progress` shows its display only if ``enabled``. The trainer wraps the
    work it calls in other components (a data source's ``evaluate``) in ``live_progress(trainer.progress)``."""
    token = _SHOWN.set(enabled)
    try:
        yield
    finally:
        _SHOWN.reset(token)


@contextmanager
def task_progress(
    total: int, description: str, *, unit: str = "it", console: Console | None = None
) -> Iterator[Callable[[int], None]]:
    """``advance(n)`` for work of ``total`` units: a live display on a terminal, a no-op elsewhere and
    inside ``live_progress(False)``. Inside the training display it shows as a second display below it."""
    if not _SHOWN.get() or (console is None and not sys.stderr.isatty()):
        yield lambda n: None
        return
    with live_display(console) as display:
        task = display.add_task(description, total=total, unit=unit, info="")
        yield lambda n: display.advance(task, n)


class Progress:
    """Training progress: ``update(step, metrics)`` after every step, ``metrics`` on logged steps.

    ``console`` forces the live display onto that console (tests); by default it is used when stderr is
    a terminal.
    """

    def __init__(self, total: int, initial: int, enabled: bool, name: str, console: Console | None = None):
        self.enabled = enabled
        self.tty = console is not None or sys.stderr.isatty()
        self.total = total
        self.name = name
        self._display: RichProgress | None = None
        self._task: Any = None
        if enabled and self.tty:
            self._display = live_display(console)
            self._task = self._display.add_task(name, total=total, completed=initial, unit="step", info="")
            self._display.start()

    @staticmethod
    def _fields(metrics: dict[str, float]) -> dict[str, str]:
        return {
            "loss": f"{metrics['loss']:.4f}",
            "samples/s": f"{metrics['samples_per_s']:,.0f}",
            "tokens/s": f"{metrics['tokens_per_s']:,.0f}",
            "MFU": f"{100 * metrics['mfu']:.2f}%",
        }

    @classmethod
    def _live_info(cls, metrics: dict[str, float]) -> str:
        """The live display's last column: what tells most first, as a narrow terminal cuts its end."""
        fields = cls._fields(metrics)
        return "  ".join(f"{k} {fields[k]}" for k in ("loss", "tokens/s", "MFU", "samples/s"))

    def update(self, step: int, metrics: dict[str, float] | None) -> None:
        if not self.enabled:
            return
        if self._display is not None:
            info = None if metrics is None else self._live_info(metrics)
            self._display.update(self._task, advance=1, **({} if info is None else {"info": info}))
        elif metrics is not None:
            fields = "  ".join(f"{k} {v}" for k, v in self._fields(metrics).items())
            print(f"[{self.name}] step {step + 1}/{self.total}  {fields}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._display is not None:
            self._display.stop()
            self._display = None
