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
one program's registers (:data:`ONE_PASS_MAX_N` elements): each program reads whole rows, takes their
amax in registers and writes the e4m3 rows and scales, adding the rows into its column-sum partials
when the bias gradient is asked for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_precision.formats import Fp8Format
from gem_precision.fp8_reference import Fp8Operand, Fp8Pair, Granularity, check_col_amax_bits, round_up
from gem_precision.triton_common import (
    abs_bits,
    cast_to_fp8_bits,
    check_triton_device,
    fp8_kernel_constants,
    interpreting,
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
def _pow2_scale(amax_bits, EMAX: tl.constexpr):
    """(2**s, 2**-s, non-finite) with s the largest integer such that amax * 2**s <= fp8 max."""
    floor_log2 = (amax_bits >> 23) - 127
    s = EMAX - floor_log2 - ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # max = 1.75 * 2**EMAX
    s = tl.minimum(tl.maximum(s, -126), 126)
    nonfinite = amax_bits >= 0x7F800000
    # NaN as explicit bits (formats.FP32_NAN_BITS), the same payload the reference writes
    scale = tl.where(nonfinite, 0x7FC00000, (127 + s) << 23).to(tl.float32, bitcast=True)
    scale_inv = tl.where(nonfinite, 0x7FC00000, (127 - s) << 23).to(tl.float32, bitcast=True)
    return scale, scale_inv, nonfinite


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
        t_scale, t_inv, t_bad = _pow2_scale(tl.load(tensor_amax_ptr), EMAX)
    if ROWS:
        if TENSORWISE:
            scale, inv, bad = t_scale, t_inv, t_bad
            bits = cast_to_fp8_bits(x * scale, FP8_E5M2, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
            bits = tl.where(bad, 127, bits.to(tl.int32))
            if (pid_m == 0) & (pid_n == 0):
                tl.store(q_inv_ptr, inv)
        else:
            scale, inv, bad = _pow2_scale(tl.load(row_amax_ptr + rows, mask=rmask, other=0), EMAX)
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
            scale, inv, bad = _pow2_scale(tl.load(col_amax_ptr + cols, mask=cmask, other=0), EMAX)
            bits = cast_to_fp8_bits(x * scale[None, :], FP8_E5M2, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
            bits = tl.where(bad[None, :], 127, bits.to(tl.int32))
            if pid_m == 0:
                tl.store(qt_inv_ptr + cols, inv, mask=cmask)
        # rows past M are the zero padding of the reduction dim, NaN group or not
        bits = tl.where(rmask[:, None], bits, 0)
        out = qt_ptr + cols[None, :].to(tl.int64) * M_PAD + rows[:, None]
        tl.store(out, bits.to(tl.uint8), mask=(rows < M_PAD)[:, None] & cmask[None, :])


@triton.jit
def _fp8_rows_once_kernel(
    x_ptr, M, N, stride_xm, q_ptr, q_inv_ptr, col_sum_ptr,
    COL_SUM: tl.constexpr, FP8_E5M2: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
    ROWS_PER_PROG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Row-scaled fp8 of ``ROWS_PER_PROG`` whole rows (``N <= BLOCK_N``), ``BLOCK_M`` at a time, in one
    read; with ``COL_SUM`` this program's column sums into ``col_sum [programs, N]``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    sum_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.range(0, ROWS_PER_PROG, BLOCK_M):
        rows = pid * ROWS_PER_PROG + i + tl.arange(0, BLOCK_M)
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        scale, inv, bad = _pow2_scale(tl.max(abs_bits(x), axis=1), EMAX)
        bits = cast_to_fp8_bits(x * scale[:, None], FP8_E5M2, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
        bits = tl.where(bad[:, None], 127, bits.to(tl.int32))
        tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], bits.to(tl.uint8), mask=mask)
        tl.store(q_inv_ptr + rows, inv, mask=rmask)
        if COL_SUM:
            sum_acc += x
    if COL_SUM:  # reduced across the tile's rows once, after the loop (see the stats kernel)
        tl.store(col_sum_ptr + pid * N + cols, tl.sum(sum_acc, axis=0), mask=cmask)


ONE_PASS_MAX_N = 4096
"""Widest row the one-pass row quantization takes (its rows are held in registers whole)."""


ONE_PASS_TILE = (4096, 4)
"""(elements a step, warps) of the one-pass row kernel on a GPU. sm_90 compiles (no spills): 4096
elements on 4 warps take 137-168 registers with the column sums, 3 programs an SM, 24 KB of loads in
flight an SM; 8192 on 8 warps 162-178 registers, one program, 16 KB."""


def _one_pass_tiles(n: int) -> tuple[int, int, int, int]:
    """(ROWS_PER_PROG, BLOCK_M, BLOCK_N, warps) of the one-pass row kernel for rows of ``n`` elements:
    128 rows a program as in the stats pass, so that the column-sum partials stay small."""
    if interpreting():
        block_n = triton.next_power_of_2(max(n, 1))
        return 16, max(1, 256 // block_n), block_n, 4
    elements, warps = ONE_PASS_TILE
    block_n = triton.next_power_of_2(max(n, 16))
    return 128, max(1, elements // block_n), block_n, warps


def _quantize_rows_once(x: torch.Tensor, fmt: Fp8Format, *, col_sum: bool, software_round: bool | None) -> Fp8Pair:
    m, n = x.shape
    rows_per_prog, block_m, block_n, warps = _one_pass_tiles(n)
    programs = triton.cdiv(m, rows_per_prog)
    q = torch.empty((m, n), dtype=torch.uint8, device=x.device)
    q_inv = torch.empty(m, dtype=torch.float32, device=x.device)
    sums = torch.empty((programs, n) if col_sum else (1, 1), dtype=torch.float32, device=x.device)
    if m and n:
        _fp8_rows_once_kernel[(programs,)](
            x, m, n, x.stride(0), q, q_inv, sums, COL_SUM=col_sum, **fp8_kernel_constants(fmt),
            SOFTWARE_ROUND=software_rounding_default() if software_round is None else software_round,
            ROWS_PER_PROG=rows_per_prog, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
        )  # fmt: skip
    elif col_sum:
        sums = torch.zeros((1, n), dtype=torch.float32, device=x.device)
    rows_op = Fp8Operand(q.view(fmt.dtype), q_inv.view(-1, 1))
    return Fp8Pair(rows_op, None, sums.sum(dim=0) if col_sum else None)


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
    alone, rows up to :data:`ONE_PASS_MAX_N` wide); with
    ``col_amax_bits`` (the producer's column maxima) the stats pass drops them, and runs not at all
    when nothing else is asked of it (``rows`` false, no ``col_sum``)."""
    check_triton_device(x, "quantize_fp8_triton")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_fp8_triton: expected a 2-d tensor with contiguous rows, got {x.shape} {x.stride()}")
    if granularity not in ("tensor", "row"):
        raise ValueError(f"quantize_fp8_triton: granularity must be 'tensor' or 'row', got {granularity!r}")
    check_col_amax_bits(col_amax_bits, x, granularity, "quantize_fp8_triton")
    m, n = x.shape
    if rows and not cols_t and granularity == "row" and n <= ONE_PASS_MAX_N:
        return _quantize_rows_once(x, fmt, col_sum=col_sum, software_round=software_round)
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


# ------------------------------------------- one-pass row-wise quantize / dequantize (saved tensors)


@triton.jit
def _fp8_rows_kernel(
    x_ptr, M, N, stride_xm, q_ptr, q_inv_ptr,
    EMAX: tl.constexpr, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_CHUNK: tl.constexpr,
):  # fmt: skip
    # e4m3 with one scale per row, every row in this program: the amax is a register reduction, not
    # a second kernel and atomics. When a row fits one chunk (ONE_CHUNK) x is read once; otherwise
    # the second read of this program's rows comes from L2.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    q_rows = q_ptr + rows[:, None].to(tl.int64) * N
    cols = tl.arange(0, BLOCK_N)
    if ONE_CHUNK:
        x = tl.load(x_rows + cols[None, :], mask=rmask[:, None] & (cols < N)[None, :], other=0.0).to(tl.float32)
        amax = tl.max(abs_bits(x), axis=1)
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.int32)
        for n0 in range(0, N, BLOCK_N):
            mask = rmask[:, None] & (n0 + cols < N)[None, :]
            x = tl.load(x_rows + n0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(abs_bits(x), axis=1))
    scale, inv, bad = _pow2_scale(amax, EMAX)
    tl.store(q_inv_ptr + rows, inv, mask=rmask)
    if ONE_CHUNK:
        bits = cast_to_fp8_bits(x * scale[:, None], False, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
        bits = tl.where(bad[:, None], 127, bits.to(tl.int32))
        tl.store(q_rows + cols[None, :], bits.to(tl.uint8), mask=rmask[:, None] & (cols < N)[None, :])
    else:
        for n0 in range(0, N, BLOCK_N):
            mask = rmask[:, None] & (n0 + cols < N)[None, :]
            x = tl.load(x_rows + n0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            bits = cast_to_fp8_bits(x * scale[:, None], False, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
            bits = tl.where(bad[:, None], 127, bits.to(tl.int32))
            tl.store(q_rows + n0 + cols[None, :], bits.to(tl.uint8), mask=mask)


@triton.jit
def _fp8_rows_dequantize_kernel(q_ptr, q_inv_ptr, out_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    inv = tl.load(q_inv_ptr + rows, mask=rows < M, other=1.0)
    tl.store(out_ptr + offs, (q * inv[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


_ROW_CHUNK = 4096  # elements of a row per chunk (fp32 in registers: BLOCK_M * BLOCK_N <= 8192)


def quantize_fp8_rows_triton(x: torch.Tensor, *, software_round: bool | None = None) -> Fp8Operand:
    """e4m3 with one power-of-two scale per row, in one kernel: the bits of
    ``quantize_fp8_reference(x, granularity="row", fmt=E4M3).rows`` (rows only, no padding)."""
    from gem_precision.formats import E4M3

    check_triton_device(x, "quantize_fp8_rows_triton")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_fp8_rows_triton: expected 2-d with contiguous rows, got {x.shape} {x.stride()}")
    m, n = x.shape
    q = torch.empty((m, n), dtype=torch.uint8, device=x.device)
    q_inv = torch.empty(m, dtype=torch.float32, device=x.device)
    block_n = min(triton.next_power_of_2(max(n, 1)), 64 if interpreting() else _ROW_CHUNK)
    block_m = max(1, min(64, (256 if interpreting() else 8192) // block_n))
    if m and n:
        _fp8_rows_kernel[(triton.cdiv(m, block_m),)](
            x, m, n, x.stride(0), q, q_inv, **{k: v for k, v in fp8_kernel_constants(E4M3).items() if k != "FP8_E5M2"},
            SOFTWARE_ROUND=software_rounding_default() if software_round is None else software_round,
            BLOCK_M=block_m, BLOCK_N=block_n, ONE_CHUNK=n <= block_n, num_warps=4 if block_m * block_n <= 2048 else 8,
        )  # fmt: skip
    return Fp8Operand(q.view(E4M3.dtype), q_inv.view(-1, 1))


def dequantize_fp8_rows_triton(op: Fp8Operand, dtype: torch.dtype) -> torch.Tensor:
    """``op.dequantize(dtype)`` for a row-scaled e4m3 operand, in one pass (no float32 copy)."""
    check_triton_device(op.data, "dequantize_fp8_rows_triton")
    m, n = op.data.shape
    out = torch.empty((m, n), dtype=dtype, device=op.data.device)
    bm, bn = (16, 64) if interpreting() else (32, 256)
    if m and n:
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
        _fp8_rows_dequantize_kernel[grid](
            op.data.view(torch.uint8), op.scale_inv.reshape(-1), out, m, n, BLOCK_M=bm, BLOCK_N=bn, num_warps=4
        )
    return out
