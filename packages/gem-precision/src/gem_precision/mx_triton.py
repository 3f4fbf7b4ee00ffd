"""Triton MXFP8 quantize / dequantize kernels, bit-identical to :mod:`gem_precision.mx_reference`.

One kernel reads a tile of ``x [R, C]`` once and writes either or both of
- the row-wise operand (blocks of 32 along C): data ``[R, C]``, scales ``[R, ceil(C/32)]``;
- the transposed operand (blocks of 32 along R): data ``[C, R]``, scales ``[C, ceil(R/32)]``,
  which is what the backward GEMMs consume (``grad_out`` needs both, from one read).
Tiles are multiples of 32 in both directions and aligned to them, so every block lies inside one
tile and no cross-program reduction is needed. Masked loads read zeros past the edges: that is the
reference's zero padding of a last partial block.

Two kernels: the 4-d tile kernel (rows at 3.25 TB/s on the H200; with cols_t its column amax crosses
warps and its transposed store moves bytes through shared memory: 1.5-1.66 TB/s), and a one-warp
column kernel for the transposed operand that keeps both inside a warp's registers (see its
comment). ``tile`` picks one; ``benchmarks/precision.py`` sweeps both, bit-checking each candidate.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_precision.mx_reference import MX_BLOCK, MXTensor
from gem_precision.triton_common import (
    abs_bits,
    cast_to_fp8_bits,
    check_triton_device,
    e8m0_to_float,
    interpreting,
    pow2_from_biased,
    software_rounding_default,
)


@triton.jit
def _mx_scale(amax_bits):
    """(e8m0 code, 2**-E as float32, non-finite) of blocks whose |max| bits are ``amax_bits``."""
    biased = amax_bits >> 23  # float32 biased exponent; 255 for inf and NaN
    nonfinite = biased == 255
    exponent = tl.minimum(tl.maximum(biased - 127 - 8, -127), 127)  # floor(log2 amax) - emax(e4m3)
    code = tl.where(nonfinite, 255, exponent + 127)
    return code, pow2_from_biased(127 - exponent), nonfinite  # 2**-E is normal for every reachable E


@triton.jit
def _mx_elements(blocks, inv, nonfinite, SOFTWARE_ROUND: tl.constexpr):
    """e4m3 bytes (as int32) of ``blocks * inv`` saturated to +-448; 0x7F where ``nonfinite``
    (``inv`` and ``nonfinite`` broadcast against ``blocks``)."""
    scaled = tl.minimum(tl.maximum(blocks * inv, -448.0), 448.0)
    bits = cast_to_fp8_bits(scaled, False, 3, 0.015625, 24576.0, SOFTWARE_ROUND)
    return tl.where(nonfinite, 127, bits.to(tl.int32))


@triton.jit
def _mx_encode(blocks, amax_bits, SOFTWARE_ROUND: tl.constexpr, BLOCK_AXIS: tl.constexpr):
    """Scale bytes and element bytes for blocks whose |max| bits are ``amax_bits``.

    ``blocks`` has the 32-element block axis at ``BLOCK_AXIS``; ``amax_bits`` is ``blocks``'s shape
    with that axis reduced away.
    """
    code, inv, nonfinite = _mx_scale(amax_bits)
    inv = tl.expand_dims(inv, BLOCK_AXIS)
    bits = _mx_elements(blocks, inv, tl.expand_dims(nonfinite, BLOCK_AXIS), SOFTWARE_ROUND)
    return code.to(tl.uint8), bits.to(tl.uint8)


@triton.jit
def _mx_quantize_kernel(
    x_ptr, R, C, stride_xr,
    q_ptr, s_ptr, ld_s,
    qt_ptr, st_ptr, ld_st,
    ROWS: tl.constexpr, COLS_T: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # The tile is addressed as 4-d [row block, row in block, column block, column in block] so that
    # both kinds of 32-blocks are plain axes (no reshape, which would pin a 1-element-per-thread
    # layout on the load), and the contiguous last axis keeps 16-byte vector loads.
    RB: tl.constexpr = BLOCK_R // 32
    CB: tl.constexpr = BLOCK_C // 32
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    i32 = tl.arange(0, 32)
    rb = tl.arange(0, RB)
    cb = tl.arange(0, CB)
    rows = pid_r * BLOCK_R + rb[:, None, None, None] * 32 + i32[None, :, None, None]
    cols = pid_c * BLOCK_C + cb[None, None, :, None] * 32 + i32[None, None, None, :]
    mask = (rows < R) & (cols < C)
    x = tl.load(x_ptr + rows.to(tl.int64) * stride_xr + cols, mask=mask, other=0.0).to(tl.float32)
    if ROWS:
        code, bits = _mx_encode(x, tl.max(abs_bits(x), axis=3), SOFTWARE_ROUND, 3)
        tl.store(q_ptr + rows.to(tl.int64) * C + cols, bits, mask=mask)
        s_rows = pid_r * BLOCK_R + rb[:, None, None] * 32 + i32[None, :, None]  # [RB, 32, 1]
        s_blocks = pid_c * CB + cb[None, None, :]  # [1, 1, CB]
        smask = (s_rows < R) & (s_blocks < tl.cdiv(C, 32))
        tl.store(s_ptr + s_rows.to(tl.int64) * ld_s + s_blocks, code, mask=smask)
    if COLS_T:
        code, bits = _mx_encode(x, tl.max(abs_bits(x), axis=1), SOFTWARE_ROUND, 1)
        tl.store(qt_ptr + cols.to(tl.int64) * R + rows, bits, mask=mask)
        s_cols = pid_c * BLOCK_C + cb[None, :, None] * 32 + i32[None, None, :]  # [1, CB, 32]
        s_blocks = pid_r * RB + rb[:, None, None]  # [RB, 1, 1]
        smask = (s_cols < C) & (s_blocks < tl.cdiv(R, 32))
        tl.store(st_ptr + s_cols.to(tl.int64) * ld_st + s_blocks, code, mask=smask)


@triton.jit
def _mx_quantize_cols_kernel(
    x_ptr, R, C, stride_xr,
    q_ptr, s_ptr, ld_s,
    qt_ptr, st_ptr, ld_st,
    ROWS: tl.constexpr, SOFTWARE_ROUND: tl.constexpr, BLOCK_C: tl.constexpr, NB: tl.constexpr,
    PACK_WORDS: tl.constexpr,
):  # fmt: skip
    # For the transposed operand (cols_t; rows too if ROWS). Launched with ONE warp: a program takes
    # one 32-row block and NB column tiles of BLOCK_C (32 or 64). A [32, BLOCK_C] bf16 tile gets
    # BLOCK_C / 8 lanes x 8 contiguous columns (16-byte loads) and L = 256 / BLOCK_C lanes on the
    # rows, each lane holding K = 32 / L rows in registers. Row i of the tile is row
    # (i % L) * K + i // L of the block, so a lane's K registers are K consecutive rows. Hence a
    # column's amax never leaves the warp (a few shuffles; the 4-d kernel reduces across warps
    # through shared memory), and 4 consecutive rows of a column pack in registers into one word of
    # the transposed output (the 4-d kernel transposes bytes through shared memory). One warp
    # because Triton puts the warps of a bigger program on the rows of this tile.
    L: tl.constexpr = 256 // BLOCK_C
    K: tl.constexpr = 32 // L
    pid_r = tl.program_id(0)
    i = tl.arange(0, 32)
    rows = pid_r * 32 + (i % L) * K + i // L  # [32]
    rmask = rows < R
    for t in tl.static_range(NB):
        cols = (tl.program_id(1) * NB + t) * BLOCK_C + tl.arange(0, BLOCK_C)
        cmask = cols < C
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xr + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        ab = abs_bits(x)
        ccode, cinv, cbad = _mx_scale(tl.max(ab, axis=0))  # [BLOCK_C]: one scale per column
        cbits = _mx_elements(x, cinv[None, :], cbad[None, :], SOFTWARE_ROUND)
        if PACK_WORDS:  # R % 4 == 0: rows 4w..4w+3 of a column are one little-endian int32
            b4 = tl.reshape(cbits, [K // 4, 4, L, BLOCK_C])  # [word in lane, byte, lane, column]
            shift = (tl.arange(0, 4) * 8)[None, :, None, None]
            words = tl.reshape(tl.sum(b4 << shift, axis=1), [K // 4 * L, BLOCK_C])  # distinct bytes: sum = OR
            j = tl.arange(0, K // 4 * L)
            w = pid_r * 8 + (j % L) * (K // 4) + j // L  # word index along the row axis of qt
            qt_words = qt_ptr.to(tl.pointer_type(tl.int32))
            wmask = (w < R // 4)[:, None] & cmask[None, :]
            tl.store(qt_words + cols[None, :].to(tl.int64) * (R // 4) + w[:, None], words, mask=wmask)
        else:
            tl.store(qt_ptr + cols[None, :].to(tl.int64) * R + rows[:, None], cbits.to(tl.uint8), mask=mask)
        tl.store(st_ptr + cols.to(tl.int64) * ld_st + pid_r, ccode.to(tl.uint8), mask=cmask)
        if ROWS:
            x3 = tl.reshape(x, [32, BLOCK_C // 32, 32])
            rcode, rinv, rbad = _mx_scale(tl.max(tl.reshape(ab, [32, BLOCK_C // 32, 32]), axis=2))
            rbits = _mx_elements(x3, rinv[:, :, None], rbad[:, :, None], SOFTWARE_ROUND)
            q_rows = q_ptr + rows[:, None].to(tl.int64) * C + cols[None, :]
            tl.store(q_rows, tl.reshape(rbits, [32, BLOCK_C]).to(tl.uint8), mask=mask)
            blk = (tl.program_id(1) * NB + t) * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
            smask = rmask[:, None] & (blk < tl.cdiv(C, 32))[None, :]
            tl.store(s_ptr + rows[:, None].to(tl.int64) * ld_s + blk[None, :], rcode.to(tl.uint8), mask=smask)


@triton.jit
def _mx_dequantize_kernel(
    q_ptr, s_ptr, out_ptr, R, C, ld_s,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    offs = rows[:, None].to(tl.int64) * C + cols[None, :]
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    sb = pid_c * (BLOCK_C // 32) + tl.arange(0, BLOCK_C // 32)
    smask = (rows < R)[:, None] & (sb < tl.cdiv(C, 32))[None, :]
    code = tl.load(s_ptr + rows[:, None].to(tl.int64) * ld_s + sb[None, :], mask=smask, other=127)
    scale = e8m0_to_float(code.to(tl.int32))
    values = tl.reshape(q, [BLOCK_R, BLOCK_C // 32, 32]) * scale[:, :, None]
    tl.store(out_ptr + offs, tl.reshape(values, [BLOCK_R, BLOCK_C]).to(out_ptr.dtype.element_ty), mask=mask)


Tile = tuple[int, int, int]
"""(BLOCK_R, BLOCK_C, num_warps) of the 4-d kernel. BLOCK_R = 0 selects the column kernel
(``_mx_quantize_cols_kernel``, needs cols_t): one warp per program, 32 rows x BLOCK_C (32 or 64)
columns, and the third number is then how many such column tiles a program does (NB)."""


def _default_tile(rows: bool, cols_t: bool) -> Tile:
    """The tile used when none is given. Under the interpreter: small, so that tests stay fast.
    Rows only: the 4-d kernel at 3.25 TB/s (H200, 16k x 8k bf16). With cols_t: the fastest tile of
    the first H200 sweep (cols_t 1.50, both 1.66 TB/s); ``benchmarks/precision.py`` sweeps the
    column kernel against these, so switch here once a run shows it ahead."""
    if interpreting():
        return 32, 64, 4
    if rows and cols_t:
        return 32, 128, 4
    if cols_t:
        return 64, 128, 4
    return 32, 256, 4


def mx_quantize_triton(
    x: torch.Tensor,
    *,
    rows: bool = True,
    cols_t: bool = False,
    software_round: bool | None = None,
    tile: Tile | None = None,
) -> tuple[MXTensor | None, MXTensor | None]:
    """Quantize ``x [R, C]``: ``(row-wise operand [R, C], transposed operand [C, R])``, each or both."""
    check_triton_device(x, "mx_quantize_triton")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"mx_quantize_triton: expected a 2-d tensor with contiguous rows, got {x.shape} {x.stride()}")
    if not (rows or cols_t):
        raise ValueError("mx_quantize_triton: ask for rows, cols_t or both")
    r, c = x.shape
    block_r, block_c, warps = tile or _default_tile(rows, cols_t)
    if block_r % MX_BLOCK or block_c % MX_BLOCK:
        raise ValueError(f"mx_quantize_triton: tile {block_r}x{block_c} must be multiples of {MX_BLOCK}")
    if block_r == 0 and (not cols_t or block_c not in (32, 64)):
        raise ValueError(
            f"mx_quantize_triton: the column kernel (BLOCK_R = 0) needs cols_t and BLOCK_C 32 or 64, got {tile}"
        )
    dev = x.device
    q = torch.empty((r, c) if rows else (1, 1), dtype=torch.uint8, device=dev)
    s = torch.empty((r, triton.cdiv(c, MX_BLOCK)) if rows else (1, 1), dtype=torch.uint8, device=dev)
    qt = torch.empty((c, r) if cols_t else (1, 1), dtype=torch.uint8, device=dev)
    st = torch.empty((c, triton.cdiv(r, MX_BLOCK)) if cols_t else (1, 1), dtype=torch.uint8, device=dev)
    sw = software_rounding_default() if software_round is None else software_round
    args = (x, r, c, x.stride(0), q, s, s.stride(0), qt, st, st.stride(0))
    if r and c and block_r == 0:
        grid = (triton.cdiv(r, MX_BLOCK), triton.cdiv(c, block_c * warps))
        _mx_quantize_cols_kernel[grid](
            *args, ROWS=rows, SOFTWARE_ROUND=sw, BLOCK_C=block_c, NB=warps, PACK_WORDS=r % 4 == 0, num_warps=1
        )
    elif r and c:
        grid = (triton.cdiv(r, block_r), triton.cdiv(c, block_c))
        _mx_quantize_kernel[grid](
            *args, ROWS=rows, COLS_T=cols_t, SOFTWARE_ROUND=sw, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps
        )
    e4m3, e8m0 = torch.float8_e4m3fn, torch.float8_e8m0fnu
    row_op = MXTensor(q.view(e4m3), s.view(e8m0)) if rows else None
    col_op = MXTensor(qt.view(e4m3), st.view(e8m0)) if cols_t else None
    return row_op, col_op


def mx_dequantize_triton(mx: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``mx`` as ``dtype`` (exact for float32 and bfloat16), like :func:`mx_dequantize`."""
    check_triton_device(mx.data, "mx_dequantize_triton")
    r, c = mx.shape
    out = torch.empty((r, c), dtype=dtype, device=mx.data.device)
    block_r, block_c, warps = (32, 64, 4) if interpreting() else (32, 256, 4)
    if r and c:
        grid = (triton.cdiv(r, block_r), triton.cdiv(c, block_c))
        scale = mx.scale.view(torch.uint8)
        _mx_dequantize_kernel[grid](
            mx.data.view(torch.uint8), scale, out, r, c, scale.stride(0),
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=warps,
        )  # fmt: skip
    return out
