"""The ``uvqk`` projection's bias gradient, summed by the fused gap's backward passes (imports triton).

The bias gradient of a linear is the column sum of its output's gradient. Left to the linear, it is
one more pass over that gradient (``[L, 4 H D]``, the largest activation of a block) after the gap's
backward wrote it: on the H200's big config the bias reductions took 4.5 ms of a 230 ms step
(``benchmarks/results/e2e_ab.md``). Three quarters of that gradient's columns (``v, q, k``) are written
by the gap's in-place ``silu'`` pass, which here also sums what it writes, per column, in fp32
(:func:`silu_grad_columns`): each program walks down a column block over many row tiles, keeps its
running sums in registers and writes one partial row; the few partial rows are added at the end (no
atomics, deterministic). The ``u`` columns, written by the norm-gate backward, are summed by one torch
reduction over them: with the sums inside, that kernel compiled for sm_90 to 178 registers a thread
(128 without), one program of 8 warps per SM instead of two, a likely loss for a bandwidth-bound pass.

The sums are of the values as stored (rounded to the gradient's dtype), so they equal the linear's
own ``grad.sum(0)`` up to the order of the fp32 additions.

The linear must then not sum again: :func:`gem_model.api.bias_grad_elsewhere` lends the fused block
the linear with its bias detached (the GEMM still adds it in its epilogue), and the gap returns the
bias gradient as the gradient of an input of its own. An option, ``kernels.jagged_attention.options.
bias_grad_in_gap``, off: with this module's pass the step measured 0.946x the step without it on an
H200 (big config, 2026-12-02). At 80 registers on 8 warps three programs fit on an SM, each with one
tile in flight, against six of the plain pass (79 registers on 4 warps): half the loads in flight for a
pass bound by them, and a cross-warp reduction per tile (``benchmarks/results/e2e_ab.md``). So rows
that fit in registers whole (up to 8,192 wide) now take the fp8 path's pass over whole rows instead,
without its e4m3 rows (:func:`gem_kernels.hstu_gap_grad_rows.silu_grad_rows`), which sums the ``u``
columns too; this module's pass stays for wider rows. The whole-row path was measured on the H200
(1.007-1.008x on the step, 2026-12-04) and is on by default.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard, num_programs, silu_grad
from gem_kernels.quantized_rows_triton import load_rows

ROWS, COLS = (4, 64) if INTERPRET else (16, 256)
WARPS = 8
"""The tile of ``hstu_gap_triton.silu_columns``, on twice its warps: compiled for sm_90, the running
column sums take 128 registers a thread on 4 warps (the plain pass: 79) and 80 on 8."""
PROGRAMS_PER_SM = 8


@triton.jit
def _silu_grad_columns(X, PRE, SCALE_INV, OUT, SUMS, stride_x, stride_pre, stride_out, num_rows, num_cols,
                       tiles_per_program, E4M3: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                       INTERP: tl.constexpr):  # fmt: skip
    """``OUT = X * silu'(PRE)`` over ``[num_rows, num_cols]`` (``E4M3``: ``PRE`` is e4m3 bytes, each row
    times its ``SCALE_INV``), and ``SUMS[program row, col]`` = the column sums of ``OUT`` as stored over
    this program's row tiles."""
    pid_rows = tl.program_id(0)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    cols_ok = cols < num_cols
    sums = tl.zeros([COLS], dtype=tl.float32)
    for t in range(0, tiles_per_program):
        rows = ((pid_rows * tiles_per_program + t) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        rows_ok = rows < num_rows
        inside = rows_ok[:, None] & cols_ok[None, :]
        z = load_rows(PRE, SCALE_INV, rows, cols, rows_ok, inside, stride_pre, E4M3)
        g = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        result = cast(g * silu_grad(z), OUT.dtype.element_ty, INTERP)
        tl.store(OUT + rows[:, None] * stride_out + cols[None, :], result, mask=inside)
        sums += tl.sum(tl.where(inside, result.to(tl.float32), 0.0), 0)
    tl.store(SUMS + pid_rows * num_cols + cols, sums, mask=cols_ok)


def silu_grad_columns(pre: torch.Tensor, out: torch.Tensor, grad: torch.Tensor,
                      scale_inv: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``out[:] = grad * silu'(pre)`` as ``hstu_gap_triton.silu_columns`` writes it (``[rows, cols]``
    views with unit column stride; ``out`` may be ``grad``), and the float32 column sums of ``out`` as
    stored, ``[cols]``. With ``scale_inv`` ``[rows]``, ``pre`` is e4m3 and stands for ``pre *
    scale_inv[:, None]``."""
    num_rows, num_cols = pre.shape
    if not num_rows:
        return torch.zeros(num_cols, dtype=torch.float32, device=pre.device)
    col_blocks = triton.cdiv(num_cols, COLS)
    row_tiles = triton.cdiv(num_rows, ROWS)
    if INTERPRET:  # a few programs, so that the tests see partial rows merged and programs with tiles to spare
        row_programs = min(row_tiles, 3)
    else:  # the device filled: PROGRAMS_PER_SM programs per SM over all column blocks
        programs = num_programs(pre.device, PROGRAMS_PER_SM, row_tiles * col_blocks)
        row_programs = max(1, min(row_tiles, programs // col_blocks))
    tiles_per_program = triton.cdiv(row_tiles, row_programs)
    row_programs = triton.cdiv(row_tiles, tiles_per_program)
    sums = torch.empty((row_programs, num_cols), dtype=torch.float32, device=pre.device)
    e4m3 = scale_inv is not None
    with device_guard(pre.device):
        _silu_grad_columns[(row_programs, col_blocks)](
            grad, pre.view(torch.uint8) if e4m3 else pre, scale_inv if e4m3 else pre, out, sums, grad.stride(0),
            pre.stride(0), out.stride(0), num_rows, num_cols, tiles_per_program, E4M3=e4m3, ROWS=ROWS, COLS=COLS,
            INTERP=INTERPRET, num_warps=WARPS,
        )  # fmt: skip
    return sums.sum(0)
