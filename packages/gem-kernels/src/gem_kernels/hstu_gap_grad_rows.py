"""The fused HSTU gap's last backward pass, writing the e4m3 rows of the gradient it completes (imports triton).

The gradient of the gap's input, ``d_pre [L, W]`` (``W = H (2 Dv + 2 Dqk)``, columns ``u, v, q, k``), is
the ``uvqk`` projection's output gradient. Under ``fp8_rowwise`` that linear's backward quantizes its
rows for ``dx`` (one more read of the block's widest gradient) and sums its columns for the bias. Its
rows are all written by the gap's backward: the ``u`` columns by the norm-gate backward, then ``v, q,
k`` by the pass that multiplies the attention's gradients by ``silu'(pre)``.

When the linear asks (``gem_model.api.GradRowsSlot``), that last pass runs here over whole rows
(:func:`silu_grad_rows`): each program holds one row of ``W`` columns in registers, multiplies its ``v,
q, k`` columns (``q`` read from the atomic ``dq``'s float32 accumulator, when it has one) by
``silu'(pre)`` and stores them, reads the ``u`` columns as the norm-gate backward stored them, and
writes the row's e4m3 bytes and scale from the values as stored (the bits of gem-precision's row
quantizer: :func:`gem_kernels.quantized_rows_triton.write_e4m3_rows`), with the column sums of the
whole gradient when asked. The gap then offers them to the slot, and the linear quantizes nothing.

Per token at the big config (W = 4096, bf16) this pass moves 26 KiB, where the plain in-place pass
and the linear's one-pass row quantization moved 32 (the ``u`` columns are read once more; the
gradient's second read and the bias's separate sum of the ``u`` columns are gone).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard, silu_grad
from gem_kernels.quantized_rows_triton import RowsOut, load_rows, write_e4m3_rows
from gem_model.api import GradRowsSlot, RowQuantization

MAX_WIDTH = 8192
"""Widest gradient row held in registers whole; a wider gap leaves the quantization to the linear."""
ROWS_PER_PROGRAM = 8 if INTERPRET else 128
"""Rows a program walks (few programs, so that the column-sum partials stay small)."""
WARPS_SUMS_ONLY = 16
"""Warps of a program whose rows are 4096 or more wide when it writes no e4m3 rows and reads no ``dq``
accumulator (the bf16 step's bias sums, ``bias_grad_in_gap``). Measured on the H200 at 200,000 x 4,096
(``benchmarks/grad_rows.py``, 2026-12-03): 1.078 ms on 16 warps, 1.251 on 8, 1.422 on 4; two rows an
iteration 1.098 (8 and 16 warps), 1.671 (4); the in-place ``silu'`` pass and the linear's reduction 1.315."""
PIPELINE_STAGES = 3
"""Rows a program's loads run ahead of its math (``tl.range(..., num_stages=...)``), without the ``dq``
accumulator (not measured with it, so it runs without). At 200,000 x 4,096 on the H200
(``benchmarks/pointwise_tiles.py``, 2026-12-04, each timing including a reset copy of the gradient): the
bf16 step's sums-only pass 1.015x (16 warps), the pass that writes the e4m3 rows (``fp8_rowwise``) 1.091x
(8 warps: 2.269 -> 2.079 ms with the copy)."""
E4M3_PRE_LAUNCH = (4, 8) if INTERPRET else (64, 8)
"""(rows a program walks, warps) of the sums-only pass that reads ``pre`` from its e4m3 rows (``fp8_saved``'s
last pass). At 207,000 x 4,096 on the H200 (``benchmarks/pointwise_tiles.py --kernels silu_grad_sums_e4m3``,
2026-12-05, each timing with a reset copy of the gradient): 64 rows on 8 warps 1.811 ms, the bf16 pass's
128 rows on 16 warps 1.925 (1.063x)."""
ROWS_AT_ONCE = 2 if INTERPRET else 1
"""Rows a program loads in one iteration (more loads in flight, more registers)."""
WARPS_WIDE = {False: 8, True: 4}
"""Warps of a program whose rows are 4096 or more wide (narrower rows take 4), without and with the
``dq`` accumulator. Measured on the H200 at 200,000 x 4,096 (``benchmarks/grad_rows.py``, 2026-12-02):
in place 1.483 ms on 8 warps (1.601 on 4, 1.652 on 16; the separate passes 1.608), from the
accumulator 1.696 ms on 4 (1.939 on 8, 1.828 on 16; separate 1.711)."""


@triton.jit
def _silu_grad_rows(D_PRE, PRE, SCALE_INV, DQ, Q, Q_INV, SUMS, stride_d, stride_pre, stride_dq, num_rows, hv,
                    q_lo, q_hi, rows_per_program, W: tl.constexpr, BLOCK_W: tl.constexpr, ROWS: tl.constexpr,
                    HAS_DQ: tl.constexpr, E4M3: tl.constexpr, ROWS_OUT: tl.constexpr, COL_SUM: tl.constexpr,
                    INTERP: tl.constexpr, U_SUMMED: tl.constexpr = False, STAGES: tl.constexpr = None):  # fmt: skip
    """``D_PRE[:, hv:] *= silu'(PRE[:, hv:])`` (the ``q`` columns ``[q_lo, q_hi)`` taken from ``DQ`` when
    ``HAS_DQ``), with ``ROWS_OUT`` the e4m3 rows of the whole ``D_PRE`` as stored into ``Q``/``Q_INV``, and
    with ``COL_SUM`` this program's column sums into ``SUMS[program]``. ``U_SUMMED`` (no ``ROWS_OUT``): the
    first ``hv`` columns are not read (their sums are another kernel's; 0 here)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_W)
    cols_ok = cols < W
    grad_cols = cols_ok & (cols >= hv)
    read_cols = grad_cols if U_SUMMED else cols_ok
    in_q = (cols >= q_lo) & (cols < q_hi)
    sums = tl.zeros([BLOCK_W], dtype=tl.float32)
    for t in tl.range(0, rows_per_program, ROWS, num_stages=STAGES):
        rows = (pid * rows_per_program + t + tl.arange(0, ROWS)).to(tl.int64)
        rows_ok = rows < num_rows
        inside = rows_ok[:, None] & read_cols[None, :]
        d_ptrs = D_PRE + rows[:, None] * stride_d + cols[None, :]
        if HAS_DQ:
            g = tl.load(d_ptrs, mask=inside & (~in_q)[None, :], other=0.0).to(tl.float32)
            dq = tl.load(
                DQ + rows[:, None] * stride_dq + (cols - q_lo)[None, :], mask=inside & in_q[None, :], other=0.0
            )
            g = tl.where(in_q[None, :], dq.to(tl.float32), g)
        else:
            g = tl.load(d_ptrs, mask=inside, other=0.0).to(tl.float32)
        z = load_rows(PRE, SCALE_INV, rows, cols, rows_ok, inside & grad_cols[None, :], stride_pre, E4M3)
        stored = cast(tl.where(grad_cols[None, :], g * silu_grad(z), g), D_PRE.dtype.element_ty, INTERP)
        tl.store(d_ptrs, stored, mask=inside & grad_cols[None, :])
        y = stored.to(tl.float32)
        if ROWS_OUT:
            write_e4m3_rows(y, rows, cols, rows_ok, cols_ok, Q, Q_INV, W)
        if COL_SUM:
            sums += tl.sum(tl.where(inside, y, 0.0), 0)
    if COL_SUM:
        tl.store(SUMS + pid * W + cols, sums, mask=cols_ok)


def _launch(block_w: int, rows_out: bool, has_dq: bool, e4m3: bool) -> tuple[int, int]:
    """(rows a program walks, warps)."""
    if block_w < 4096:
        return ROWS_PER_PROGRAM, 4
    if rows_out or has_dq:
        return ROWS_PER_PROGRAM, WARPS_WIDE[has_dq]
    return E4M3_PRE_LAUNCH if e4m3 else (ROWS_PER_PROGRAM, WARPS_SUMS_ONLY)


def fits(width: int) -> bool:
    """Whether a gradient row this wide is quantized here (else the linear does it)."""
    return width <= MAX_WIDTH


def silu_grad_rows(pre: torch.Tensor, d_pre: torch.Tensor, hv: int, out: RowsOut | None, *,
                   dq: tuple[torch.Tensor, slice] | None = None, scale_inv: torch.Tensor | None = None,
                   col_sum: bool = False, u_summed: bool = False) -> torch.Tensor | None:  # fmt: skip
    """Complete ``d_pre [L, W]`` in place: its columns from ``hv`` on times ``silu'(pre)`` (with ``dq`` =
    ``(accumulator [L, q columns], the q columns' slice)``, those columns read from the accumulator
    instead), the ``hv`` before them taken as stored; write its e4m3 rows into ``out`` (None: no rows, the
    bf16 step's bias sums alone); return the float32 column sums ``[W]`` of ``d_pre`` as stored when
    ``col_sum``, else None. ``scale_inv [L]``: ``pre`` is e4m3 rows, each standing for itself times its
    factor (:mod:`gem_kernels.hstu_gap_saved`). ``u_summed`` (column sums without rows): the first ``hv``
    columns are neither read nor summed here (their sums, 0 in the result, come from the kernel that wrote
    them: :data:`gem_kernels.hstu_gap_triton.U_SUMS_IN_NORM_GATE`)."""
    num_rows, width = d_pre.shape
    if not fits(width):
        raise ValueError(f"silu_grad_rows: rows of at most {MAX_WIDTH} columns, got {width}")
    if pre.shape != d_pre.shape or d_pre.stride(1) != 1 or pre.stride(1) != 1:
        raise ValueError(f"silu_grad_rows: pre {tuple(pre.shape)} and d_pre {tuple(d_pre.shape)} must be the same "
                         "shape with contiguous rows")  # fmt: skip
    if out is not None and (out.data.shape != (num_rows, width) or out.column_amax_bits is not None):
        raise ValueError(f"silu_grad_rows: out must hold [{num_rows}, {width}] rows without column maxima")
    if out is None and not col_sum:
        raise ValueError("silu_grad_rows: neither rows nor column sums asked for (the plain pass is silu_columns)")
    if u_summed and (out is not None or not col_sum):
        raise ValueError("silu_grad_rows: u_summed skips the first hv columns, so it takes column sums without rows")
    e4m3 = scale_inv is not None
    block_w = triton.next_power_of_2(width)
    rows_per_program, warps = _launch(block_w, out is not None, dq is not None, e4m3)
    programs = max(1, triton.cdiv(num_rows, rows_per_program))
    sums = torch.empty((programs, width) if col_sum else (1,), dtype=torch.float32, device=d_pre.device)
    if not num_rows:
        return sums.zero_()[0] if col_sum else None
    accum, q_cols = dq if dq is not None else (d_pre, slice(0, 0))
    with device_guard(d_pre.device):
        _silu_grad_rows[(programs,)](
            d_pre, pre.view(torch.uint8) if e4m3 else pre, scale_inv if e4m3 else pre, accum,
            sums if out is None else out.data, sums if out is None else out.scale_inv, sums, d_pre.stride(0),
            pre.stride(0), accum.stride(0), num_rows, hv, q_cols.start, q_cols.stop, rows_per_program, W=width,
            BLOCK_W=block_w, ROWS=ROWS_AT_ONCE, HAS_DQ=dq is not None, E4M3=e4m3, ROWS_OUT=out is not None,
            COL_SUM=col_sum, INTERP=INTERPRET, U_SUMMED=u_summed, num_warps=warps,
            STAGES=PIPELINE_STAGES if dq is None else None,
        )  # fmt: skip
    return sums.sum(0) if col_sum else None


def complete_with_rows(pre: torch.Tensor, d_pre: torch.Tensor, hv: int, slot: GradRowsSlot,
                       dq_accum: torch.Tensor | None, q_cols: slice, scale_inv: torch.Tensor | None,
                       bias_sums: bool) -> torch.Tensor | None:  # fmt: skip
    """The fused gap's last pass over whole rows (:func:`silu_grad_rows`), offering ``d_pre``'s e4m3 rows (and
    column sums, when the slot asks) to the ``uvqk`` linear's backward; returns the column sums when
    ``bias_sums`` (the gap sums the lent bias's gradient), else None."""
    rows_out = RowsOut.allocate(pre.shape[0], pre.shape[1], pre.device, RowQuantization())
    dq = None if dq_accum is None else (dq_accum.view(pre.shape[0], -1), q_cols)
    col_sum = silu_grad_rows(pre, d_pre, hv, rows_out, dq=dq, scale_inv=scale_inv, col_sum=bias_sums or slot.column_sum)
    slot.offer(d_pre, rows_out.result(), col_sum if slot.column_sum else None)
    return col_sum if bias_sums else None
