"""Fused Triton fp8 quantization (tensorwise and rowwise), bit-identical to
:func:`gem_precision.fp8_reference.quantize_fp8_reference`.

Unfused torch quantization made fp8 rowwise slower than bf16 on the H200 (0.53x): every amax, scale,
multiply, cast and transpose was its own pass over a 512 MiB tensor. Here a quantization is two
passes whatever is asked for:

1. stats: one read of ``x [M, N]`` gives the row amaxes, the column amaxes, the tensor amax and the
   column sums (the bias gradient), each only when asked for. Amaxes are kept as int32 bit patterns
   (non-negative floats order as their bits), so their maxima are exact, order-independent
   (deterministic) and NaN-propagating. Row amaxes are per-column-tile partials, stored and then
   reduced by one small ``amax``; column amaxes use ``atomic_max``, one per column per program.
   Column sums are per-program partials, summed afterwards in a fixed order (deterministic too).
   Row atomics were the first design: at M = 230k, N = 4096 that is 7.4M atomics on one tensor, and
   the stats pass took 79 ms of a 311 ms fp8 training step on the H200 (2026-12-01, e2e.py).
2. cast: one more read writes the row-major operand (row or tensor scales) and the transposed
   operand ``[N, M_pad]`` (column or tensor scales, zero-padded to ``M_pad``), plus the
   dequantization factors, from the same registers.
The second read mostly hits L2 only for small tensors; for the large ones the cost is ~2 reads +
the fp8 writes, against ~8 passes unfused. When the kernel that produced ``x`` already wrote its row
operand and column amaxes (``gem_model.api.PrequantizedRows``, ``col_amax_bits``), only the cast of
the transposed operand remains: one read.

Row scales alone (no transposed operand: ``fp8_rowwise``'s gradient for ``dx`` under its bf16 weight
gradient, and its input when no producer wrote the rows) take one pass instead, when a row fits in
one program's registers (:mod:`gem_precision.fp8_rows_triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_precision import fp8_rows_triton
from gem_precision.formats import Fp8Format
from gem_precision.fp8_reference import Fp8Operand, Fp8Pair, Granularity, check_col_amax_bits, round_up
from gem_precision.triton_common import (
    abs_bits,
    cast_to_fp8_bits,
    check_triton_device,
    fp8_kernel_constants,
    interpreting,
    pow2_scale,
    software_rounding_default,
)


@triton.jit
def _fp8_stats_kernel(
    x_ptr, M, N, stride_xm,
    row_part_ptr, col_amax_ptr, tensor_amax_ptr, col_sum_ptr,
    ROW: tl.constexpr, COL: tl.constexpr, TENSOR: tl.constexpr, COL_SUM: tl.constexpr,
    ROWS_PER_PROG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """``row_part [cdiv(N, BLOCK_N), M]``: each column tile's row amaxes (bits), reduced by the caller."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    # column maxima and sums are kept per element of the tile and reduced over its rows once, after
    # the loop: a reduction along axis 0 crosses warps (shared memory and a barrier), and doing it
    # every iteration held the pass to ~0.4 TB/s on the H200. Row maxima reduce within a warp.
    col_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    sum_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.static_range(0, ROWS_PER_PROG, BLOCK_M):
        rows = pid_m * ROWS_PER_PROG + i + tl.arange(0, BLOCK_M)
        mask = (rows < M)[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        bits = abs_bits(x)
        if ROW:
            tl.store(row_part_ptr + pid_n.to(tl.int64) * M + rows, tl.max(bits, axis=1), mask=rows < M)
        if COL or TENSOR:
            col_acc = tl.maximum(col_acc, bits)
        if COL_SUM:
            sum_acc += x
    col_max = tl.max(col_acc, axis=0)
    col_sum = tl.sum(sum_acc, axis=0)
    if COL:
        tl.atomic_max(col_amax_ptr + cols, col_max, mask=cmask, sem="relaxed")
    if TENSOR:
        tl.atomic_max(tensor_amax_ptr, tl.max(col_max, axis=0), sem="relaxed")
    if COL_SUM:
        tl.store(col_sum_ptr + pid_m * N + cols, col_sum, mask=cmask)


@triton.jit
def _fp8_cast_kernel(
    x_ptr, M, N, stride_xm,
    row_amax_ptr, col_amax_ptr, tensor_amax_ptr,
    q_ptr, q_inv_ptr, qt_ptr, qt_inv_ptr, M_PAD,
    ROWS: tl.constexpr, COLS_T: tl.constexpr, TENSORWISE: tl.constexpr,
    FP8_E5M2: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < M
    cmask = cols < N
    x = tl.load(
        x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=rmask[:, None] & cmask[None, :], other=0.0
    )
    x = x.to(tl.float32)
    if TENSORWISE:
        t_scale, t_inv, t_bad = pow2_scale(tl.load(tensor_amax_ptr), EMAX)
    if ROWS:
        if TENSORWISE:
            scale, inv, bad = t_scale, t_inv, t_bad
            bits = cast_to_fp8_bits(x * scale, FP8_E5M2, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
            bits = tl.where(bad, 127, bits.to(tl.int32))
            if (pid_m == 0) & (pid_n == 0):
                tl.store(q_inv_ptr, inv)
        else:
            scale, inv, bad = pow2_scale(tl.load(row_amax_ptr + rows, mask=rmask, other=0), EMAX)
            bits = cast_to_fp8_bits(x * scale[:, None], FP8_E5M2, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
            bits = tl.where(bad[:, None], 127, bits.to(tl.int32))
            if pid_n == 0:
                tl.store(q_inv_ptr + rows, inv, mask=rmask)
        out = q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(out, bits.to(tl.uint8), mask=rmask[:, None] & cmask[None, :])
    if COLS_T:
        if TENSORWISE:
            scale, inv, bad = t_scale, t_inv, t_bad
            bits = cast_to_fp8_bits(x * scale, FP8_E5M2, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
            bits = tl.where(bad, 127, bits.to(tl.int32))
            if (pid_m == 0) & (pid_n == 0):
                tl.store(qt_inv_ptr, inv)
        else:
            scale, inv, bad = pow2_scale(tl.load(col_amax_ptr + cols, mask=cmask, other=0), EMAX)
            bits = cast_to_fp8_bits(x * scale[None, :], FP8_E5M2, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
            bits = tl.where(bad[None, :], 127, bits.to(tl.int32))
            if pid_m == 0:
                tl.store(qt_inv_ptr + cols, inv, mask=cmask)
        # rows past M are the zero padding of the reduction dim, NaN group or not
        bits = tl.where(rmask[:, None], bits, 0)
        out = qt_ptr + cols[None, :].to(tl.int64) * M_PAD + rows[:, None]
        tl.store(out, bits.to(tl.uint8), mask=(rows < M_PAD)[:, None] & cmask[None, :])


def _cast_software_round(asked: bool | None, tensorwise: bool, rows: bool, cols_t: bool) -> bool:
    """The rounding path of the cast kernel. Tensor scales with both outputs use the software
    rounding: on the H200 (Triton 3.6) the hardware cast then wrote wrong bytes into some rows of
    the row-major operand when N is not a multiple of 16 (the two stores share one converted
    tensor), while the software path was bit-exact on the same inputs (benchmarks/precision.py,
    2026-11-30)."""
    if asked is not None:
        return asked
    return True if tensorwise and rows and cols_t else software_rounding_default()


def _tiles() -> dict[str, int]:
    if interpreting():  # tiny tiles keep the interpreter fast
        return {"stats_rows": 32, "stats_m": 16, "stats_n": 32, "cast_m": 16, "cast_n": 32, "warps": 4, "stats_warps": 4}
    # stats: 128 rows x 64 columns per program in two 64-row steps, 4 warps: 2.15 TB/s on the H200
    # against 1.16 for 512 x 128 in 32-row steps with 8 warps (benchmarks/fp8_stats.py, 2026-12-01)
    return {"stats_rows": 128, "stats_m": 64, "stats_n": 64, "cast_m": 64, "cast_n": 128, "warps": 8,
            "stats_warps": 4}


def quantize_fp8_triton(
    x: torch.Tensor,
    *,
    granularity: Granularity,
    fmt: Fp8Format,
    rows: bool = True,
    cols_t: bool = False,
    col_sum: bool = False,
    pad_to: int = 1,
    software_round: bool | None = None,
    col_amax_bits: torch.Tensor | None = None,
) -> Fp8Pair:
    """Same contract and bits as :func:`quantize_fp8_reference`, in two fused passes (one for row scales
    alone, rows up to ``fp8_rows_triton.ONE_PASS_MAX_N`` wide); with
    ``col_amax_bits`` (the producer's column maxima) the stats pass drops them, and runs not at all
    when nothing else is asked of it (``rows`` false, no ``col_sum``)."""
    check_triton_device(x, "quantize_fp8_triton")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_fp8_triton: expected a 2-d tensor with contiguous rows, got {x.shape} {x.stride()}")
    if granularity not in ("tensor", "row"):
        raise ValueError(f"quantize_fp8_triton: granularity must be 'tensor' or 'row', got {granularity!r}")
    check_col_amax_bits(col_amax_bits, x, granularity, "quantize_fp8_triton")
    m, n = x.shape
    if rows and not cols_t and granularity == "row" and n <= fp8_rows_triton.ONE_PASS_MAX_N:
        return fp8_rows_triton.quantize_rows(x, fmt, col_sum=col_sum, software_round=software_round)
    m_pad = round_up(m, pad_to)
    dev = x.device
    tensorwise = granularity == "tensor"
    t = _tiles()
    int_zeros = {"dtype": torch.int32, "device": dev}
    row_stats = rows and not tensorwise
    row_parts = triton.cdiv(n, t["stats_n"]) if row_stats else 1
    row_part = torch.empty((row_parts, m if row_stats else 1), **int_zeros)
    col_stats = cols_t and not tensorwise and col_amax_bits is None
    if col_amax_bits is not None:
        col_amax = col_amax_bits.contiguous()
    else:
        col_amax = torch.zeros(n if col_stats else 1, **int_zeros)
    tensor_amax = torch.zeros(1, **int_zeros)
    n_stat_progs = triton.cdiv(m, t["stats_rows"])
    sums = torch.empty((n_stat_progs, n) if col_sum else (1, 1), dtype=torch.float32, device=dev)
    if m and n and (row_stats or col_stats or tensorwise or col_sum):
        _fp8_stats_kernel[(n_stat_progs, triton.cdiv(n, t["stats_n"]))](
            x, m, n, x.stride(0), row_part, col_amax, tensor_amax, sums,
            ROW=row_stats, COL=col_stats, TENSOR=tensorwise, COL_SUM=col_sum,
            ROWS_PER_PROG=t["stats_rows"], BLOCK_M=t["stats_m"], BLOCK_N=t["stats_n"], num_warps=t["stats_warps"],
        )  # fmt: skip
    row_amax = row_part.amax(dim=0) if row_stats and m and n else row_part.new_zeros(1)
    scale_shape: tuple[int, ...] = () if tensorwise else (-1, 1)
    q = torch.empty((m, n) if rows else (1,), dtype=torch.uint8, device=dev)
    q_inv = torch.empty(m if rows and not tensorwise else 1, dtype=torch.float32, device=dev)
    qt = torch.empty((n, m_pad) if cols_t else (1,), dtype=torch.uint8, device=dev)
    qt_inv = torch.empty(n if cols_t and not tensorwise else 1, dtype=torch.float32, device=dev)
    m_grid = m_pad if cols_t else m
    if m_grid and n and (rows or cols_t):
        grid = (triton.cdiv(m_grid, t["cast_m"]), triton.cdiv(n, t["cast_n"]))
        _fp8_cast_kernel[grid](
            x, m, n, x.stride(0), row_amax, col_amax, tensor_amax, q, q_inv, qt, qt_inv, m_pad,
            ROWS=rows, COLS_T=cols_t, TENSORWISE=tensorwise, **fp8_kernel_constants(fmt),
            SOFTWARE_ROUND=_cast_software_round(software_round, tensorwise, rows, cols_t),
            BLOCK_M=t["cast_m"], BLOCK_N=t["cast_n"], num_warps=t["warps"],
        )  # fmt: skip
    rows_op = Fp8Operand(q.view(fmt.dtype), q_inv.view(scale_shape)) if rows else None
    cols_op = Fp8Operand(qt.view(fmt.dtype), qt_inv.view(scale_shape)) if cols_t else None
    return Fp8Pair(rows_op, cols_op, sums.sum(dim=0) if col_sum else None)
