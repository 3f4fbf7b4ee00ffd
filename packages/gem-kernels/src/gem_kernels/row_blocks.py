"""How the row kernels (layer norm, norm-gate, unit rows) lay rows out: each row is held whole in
registers, and a program takes a block of rows of about 8,192 values."""

from __future__ import annotations

MAX_DIM = 16384
"""The widest row a row kernel takes: rows are held in registers whole."""

VALUES_PER_PROGRAM = 8192
"""A program's rows hold about this many values (at most 16 rows, at least one)."""


def rows_per_program(block_d: int) -> int:
    """Rows a program takes when each row is padded to ``block_d`` columns."""
    return max(1, min(16, VALUES_PER_PROGRAM // block_d))
