"""Tables on the terminal, and in logs, at a width that fits their cells.

rich lays a table out to the console's width, and a console that is not a terminal (CI, a log file,
a pipe) is 80 columns wide: cells wrapped inside words (``fp8_te|nsorwi|se``) and right edges were
cut. Where the output is not a terminal, :func:`print_table` measures the table and prints it at its
natural width instead; on a terminal the terminal's width holds, as a user resizing it expects.
"""

from __future__ import annotations

import io
import sys
from typing import IO, Any

from rich.console import Console

MIN_WIDTH = 80
UNBOUNDED = 100_000


def natural_width(renderable: Any) -> int:
    """The columns ``renderable`` takes when nothing constrains it."""
    return Console(file=io.StringIO(), width=UNBOUNDED).measure(renderable).maximum


def console_for(renderable: Any, file: IO[str] | None = None) -> Console:
    """A console for ``renderable`` on ``file`` (stdout): the terminal's, or wide enough to fit it."""
    out = file if file is not None else sys.stdout
    if out.isatty():
        return Console(file=out)
    return Console(file=out, width=max(MIN_WIDTH, natural_width(renderable)))


def print_table(table: Any, file: IO[str] | None = None) -> None:
    """Print ``table`` (any rich renderable) at a width that fits its cells where ``file`` is no terminal."""
    console_for(table, file).print(table)
