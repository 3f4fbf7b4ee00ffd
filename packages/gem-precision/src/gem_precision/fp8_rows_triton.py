"""Row-scaled fp8 in one pass, and its dequantization: the bits of
``quantize_fp8_reference(x, granularity="row")``'s row operand.

Each program walks ``ROWS_PER_PROG`` rows, ``BLOCK_M`` at a time. It takes each row's amax in
registers (no stats pass and no atomics) and writes the fp8 bytes and the row's dequantization factor.
When a row fits in one chunk it is read once. A wider row is read twice, the second read mostly from
L2 (the saved-tensor hooks compress tensors of any width). With ``COL_SUM`` (one chunk only) the
program also adds its rows into column-sum partials, which the caller sums in a fixed order: the bias
gradient from the same read.

Two callers:
- :func:`gem_precision.fp8_quant_triton.quantize_fp8_triton` for row scales alone (``fp8_rowwise``'s
  ``grad_output`` for ``dx``, with the bias gradient's column sums, and its input when no producer
  wrote the rows), rows up to :data:`ONE_PASS_MAX_N` wide;
- the ``row`` granularity of ``fp8_saved``'s hooks (:mod:`gem_precision.saved_tensors`).

On the H200, a 200,000 x 4,096 bf16 gradient with its column sums takes 0.72 ms here, against 1.32 ms
in the stats and cast passes (``benchmarks/fp8_rows.py``, 2026-12-02).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_precision.formats import E4M3, Fp8Format
from gem_precision.fp8_reference import Fp8Operand, Fp8Pair
from gem_precision.triton_common import (
    abs_bits,
    cast_to_fp8_bits,
    check_triton_device,
    fp8_kernel_constants,
    interpreting,
    pow2_scale,
    software_rounding_default,
)

ONE_PASS_MAX_N = 4096
"""Widest row that ``quantize_fp8_triton`` sends here (it is held in registers whole)."""

ONE_PASS_TILE = (4096, 4)
"""(elements a step, warps) on a GPU. Compiled for sm_90 without spills: 4096 elements on 4 warps take
137-168 registers with the column sums, which fits 3 programs an SM and keeps 24 KB of loads in flight
an SM; 8192 elements on 8 warps take 162-178 registers, one program, 16 KB. Measured on the H200: 0.723
against 0.782 ms on a 200,000 x 4,096 gradient (``benchmarks/fp8_rows.py``)."""


@triton.jit
def _store_fp8(q_ptrs, x, scale, bad, mask, FP8_E5M2: tl.constexpr, MBITS: tl.constexpr,
               MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, SOFTWARE_ROUND: tl.constexpr):  # fmt: skip
    bits = cast_to_fp8_bits(x * scale[:, None], FP8_E5M2, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
    bits = tl.where(bad[:, None], 127, bits.to(tl.int32))
    tl.store(q_ptrs, bits.to(tl.uint8), mask=mask)


@triton.jit
def _fp8_rows_kernel(
    x_ptr, M, N, stride_xm, q_ptr, q_inv_ptr, col_sum_ptr,
    COL_SUM: tl.constexpr, FP8_E5M2: tl.constexpr, EMAX: tl.constexpr, MBITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
    ROWS_PER_PROG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ONE_CHUNK: tl.constexpr,
):  # fmt: skip
    """``ROWS_PER_PROG`` rows of ``x [M, N]`` to fp8 with one scale each; with ``COL_SUM`` (and
    ``ONE_CHUNK``) this program's column sums into ``col_sum [programs, N]``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    sum_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.range(0, ROWS_PER_PROG, BLOCK_M):
        rows = pid * ROWS_PER_PROG + i + tl.arange(0, BLOCK_M)
        rmask = rows < M
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        q_rows = q_ptr + rows[:, None].to(tl.int64) * N
        if ONE_CHUNK:
            mask = rmask[:, None] & (cols < N)[None, :]
            x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            scale, inv, bad = pow2_scale(tl.max(abs_bits(x), axis=1), EMAX)
            _store_fp8(q_rows + cols[None, :], x, scale, bad, mask, FP8_E5M2, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
            if COL_SUM:
                sum_acc += x
        else:
            amax = tl.zeros([BLOCK_M], dtype=tl.int32)
            for n0 in range(0, N, BLOCK_N):
                mask = rmask[:, None] & (n0 + cols < N)[None, :]
                x = tl.load(x_rows + n0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                amax = tl.maximum(amax, tl.max(abs_bits(x), axis=1))
            scale, inv, bad = pow2_scale(amax, EMAX)
            for n0 in range(0, N, BLOCK_N):
                mask = rmask[:, None] & (n0 + cols < N)[None, :]
                x = tl.load(x_rows + n0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
                _store_fp8(q_rows + n0 + cols[None, :], x, scale, bad, mask, FP8_E5M2, MBITS, MIN_NORMAL, MAGIC,
                           SOFTWARE_ROUND)  # fmt: skip
        tl.store(q_inv_ptr + rows, inv, mask=rmask)
    if COL_SUM:  # reduced across the tile's rows once, after the loop (as the stats kernel does)
        tl.store(col_sum_ptr + pid * N + cols, tl.sum(sum_acc, axis=0), mask=cols < N)


@triton.jit
def _fp8_rows_dequantize_kernel(q_ptr, q_inv_ptr, out_ptr, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    inv = tl.load(q_inv_ptr + rows, mask=rows < M, other=1.0)
    tl.store(out_ptr + offs, (q * inv[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


def _tiles(n: int, *, one_chunk: bool) -> tuple[int, int, int, int]:
    """(ROWS_PER_PROG, BLOCK_M, BLOCK_N, warps) for rows of ``n`` elements. 128 rows a program on a GPU,
    as in the stats pass, so that the column-sum partials stay small; the interpreter takes small
    tiles, and chunks of 64 unless the row must be one chunk."""
    if interpreting():
        block_n = triton.next_power_of_2(max(n, 1))
        block_n = block_n if one_chunk else min(block_n, 64)
        return 16, max(1, 256 // block_n), block_n, 4
    elements, warps = ONE_PASS_TILE
    block_n = min(triton.next_power_of_2(max(n, 16)), max(ONE_PASS_MAX_N, triton.next_power_of_2(elements)))
    return 128, max(1, elements // block_n), block_n, warps


def quantize_rows(x: torch.Tensor, fmt: Fp8Format = E4M3, *, col_sum: bool = False,
                  software_round: bool | None = None) -> Fp8Pair:  # fmt: skip
    """The row operand of ``x [M, N]`` (contiguous rows) in ``fmt`` with one power-of-two scale per row,
    and with ``col_sum`` the float32 column sums (rows up to :data:`ONE_PASS_MAX_N` wide)."""
    check_triton_device(x, "quantize_rows")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows: expected 2-d with contiguous rows, got {tuple(x.shape)} {x.stride()}")
    m, n = x.shape
    if col_sum and n > ONE_PASS_MAX_N:
        raise ValueError(f"quantize_rows: column sums need rows of at most {ONE_PASS_MAX_N} elements, got {n}")
    rows_per_prog, block_m, block_n, warps = _tiles(n, one_chunk=col_sum)
    programs = triton.cdiv(m, rows_per_prog)
    q = torch.empty((m, n), dtype=torch.uint8, device=x.device)
    q_inv = torch.empty(m, dtype=torch.float32, device=x.device)
    sums = torch.empty((programs, n) if col_sum and m else (1, n if col_sum else 1), dtype=torch.float32, device=x.device)
    if col_sum and not (m and n):
        sums.zero_()
    if m and n:
        _fp8_rows_kernel[(programs,)](
            x, m, n, x.stride(0), q, q_inv, sums, COL_SUM=col_sum, **fp8_kernel_constants(fmt),
            SOFTWARE_ROUND=software_rounding_default() if software_round is None else software_round,
            ROWS_PER_PROG=rows_per_prog, BLOCK_M=block_m, BLOCK_N=block_n, ONE_CHUNK=n <= block_n, num_warps=warps,
        )  # fmt: skip
    return Fp8Pair(Fp8Operand(q.view(fmt.dtype), q_inv.view(-1, 1)), None, sums.sum(dim=0) if col_sum else None)


def quantize_fp8_rows_triton(x: torch.Tensor, *, software_round: bool | None = None) -> Fp8Operand:
    """e4m3 with one power-of-two scale per row (rows only, no padding), for rows of any width."""
    operand = quantize_rows(x, E4M3, software_round=software_round).rows
    assert operand is not None
    return operand


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
