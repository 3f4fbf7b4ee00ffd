"""Tables and the live progress line when the output is not a wide terminal."""

from __future__ import annotations

import io
import re

from rich.console import Console
from rich.table import Table

from gem_model.terminal import print_table
from gem_model.train.progress import Progress

CELLS = ["precision", "precision.scheme=fp8_tensorwise", "871,003", "19.84", "5.6412", "41.2", "yes: chosen over fp8_rowwise"]


def test_without_a_terminal_a_table_is_as_wide_as_its_cells():
    table = Table(title="gem-train tune: 12 candidate(s) in 183 s")
    for name in ("dimension", "change", "tokens/s", "peak GB", "last loss", "s", "chosen / error"):
        table.add_column(name, overflow="fold")
    for _ in range(3):
        table.add_row(*CELLS)
    out = io.StringIO()  # a log file or a pipe: no terminal
    print_table(table, file=out)
    lines = out.getvalue().splitlines()
    rows = [line for line in lines if "precision.scheme" in line]
    assert len(rows) == 3  # each row on one line: no cell folded
    assert all(cell in rows[0] for cell in CELLS)
    assert len({len(line) for line in lines[1:]}) == 1 and len(lines[1]) > 80  # right edges intact


def test_on_an_80_column_terminal_the_progress_keeps_tokens_per_second_and_mfu():
    screen = io.StringIO()
    metrics = {"loss": 5.61234, "samples_per_s": 1234.0, "tokens_per_s": 870938.0, "mfu": 0.2904}
    console = Console(file=screen, force_terminal=True, width=80)
    progress = Progress(total=2000, initial=0, enabled=True, name="gem-h200-large", console=console)
    progress.update(0, metrics)
    progress.close()
    frames = re.split(r"[\r\n]", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue()))
    last = [f for f in frames if "gem-h200-large" in f][-1]
    assert len(last.rstrip()) <= 80
    assert "tokens/s 870,938" in last and "MFU 29.04%" in last and "loss 5.6123" in last
