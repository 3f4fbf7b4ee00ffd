"""The e4m3 rows that a kernel producing a linear's input writes beside it (imports triton).

A kernel that holds its output rows whole in registers (the layer norm of ``layer_norm_triton``, the
norm-gate of ``norm_gate_triton``) calls :func:`write_e4m3_rows` on the values it has just written,
and the linear that reads them skips its own quantization of its input: the contract and its rule
are ``gem_model.api.RowQuantization`` and ``PrequantizedRows`` (:mod:`gem_model.prequantized`).

The bits must be those of gem-precision's ``quantize_fp8_reference(y, granularity="row", fmt=E4M3)``
of the written ``y``, and gem-kernels cannot import gem-precision: the few Triton lines below repeat
its ``fp8_quant_triton._pow2_scale`` and ``triton_common.abs_bits`` / ``round_to_fp8_grid`` /
``cast_to_fp8_bits`` for e4m3 alone, with the rule's numbers taken from ``RowQuantization``. The root
test ``tests/test_producer_quantization.py`` holds them to the reference, bit for bit.

The column maxima (``RowQuantization.column_amax``) are reduced over the rows a program wrote and
then merged with one ``atomic_max`` per column per program: a producer asked for them runs
:func:`tiles_per_program` row tiles in each program, so that there are few programs per column.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard
from gem_model.api import PrequantizedRows, RowQuantization

_Q = RowQuantization
EMAX = tl.constexpr(_Q.EMAX)
MAX_FRACTION_BITS = tl.constexpr(_Q.MAX_FRACTION_BITS)
SCALE_LIMIT = tl.constexpr(_Q.SCALE_EXPONENT_LIMIT)
# rounding the float32 mantissa to MANTISSA_BITS bits, to nearest even, with integer operations
DROPPED_BITS = tl.constexpr(23 - _Q.MANTISSA_BITS)
HALF_ULP_BELOW = tl.constexpr((1 << (22 - _Q.MANTISSA_BITS)) - 1)
KEPT_MASK = tl.constexpr(-(1 << (23 - _Q.MANTISSA_BITS)))
MIN_NORMAL = tl.constexpr(_Q.MIN_NORMAL)
# 1.5 * 2**(23 + log2 of the spacing below MIN_NORMAL): adding and subtracting it rounds to that spacing
SUBNORMAL_MAGIC = tl.constexpr(1.5 * 2.0 ** (23 + round(math.log2(_Q.MIN_NORMAL)) - _Q.MANTISSA_BITS))
NAN_BYTE = tl.constexpr(_Q.NAN_BYTE)
NAN_SCALE_BITS = tl.constexpr(_Q.NAN_SCALE_BITS)
SOFTWARE_ROUND = tl.constexpr(INTERPRET)
"""Triton's interpreter rounds an fp32 -> fp8 cast ties away from zero and mishandles subnormals, so
under it the values are first put on the e4m3 grid exactly (gem-precision's triton_common says more);
on a GPU the cast is ``cvt.rn.satfinite``, round to nearest even."""

ROWS_PER_PROGRAM_WITH_COLUMNS = 32 if INTERPRET else 128
"""Rows a program covers when it also writes column maxima (gem-precision's stats pass covers 128; the
interpreter's tests see several programs merge theirs on a few dozen rows)."""


@triton.jit
def abs_bits(x):
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def pow2_scale(amax_bits):
    """(2**s, 2**-s, non-finite), s the largest integer with amax * 2**s <= 448, within +-126."""
    floor_log2 = (amax_bits >> 23) - 127
    s = EMAX - floor_log2 - ((amax_bits & 0x7FFFFF) > MAX_FRACTION_BITS).to(tl.int32)
    s = tl.minimum(tl.maximum(s, -SCALE_LIMIT), SCALE_LIMIT)
    nonfinite = amax_bits >= 0x7F800000
    scale = tl.where(nonfinite, NAN_SCALE_BITS, (127 + s) << 23).to(tl.float32, bitcast=True)
    scale_inv = tl.where(nonfinite, NAN_SCALE_BITS, (127 - s) << 23).to(tl.float32, bitcast=True)
    return scale, scale_inv, nonfinite


@triton.jit
def e4m3_bits(v):
    """Finite float32 ``v`` with |v| <= 448 -> e4m3 bytes (as int32), rounded to nearest even."""
    if SOFTWARE_ROUND:
        b = v.to(tl.int32, bitcast=True)
        lsb = (b >> DROPPED_BITS) & 1
        normal = ((b + HALF_ULP_BELOW + lsb) & KEPT_MASK).to(tl.float32, bitcast=True)  # a carry bumps the exponent
        sub = (v + SUBNORMAL_MAGIC) - SUBNORMAL_MAGIC
        sub = (sub.to(tl.int32, bitcast=True) | ((b >> 31) << 31)).to(tl.float32, bitcast=True)
        v = tl.where(tl.abs(v) < MIN_NORMAL, sub, normal)
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)


@triton.jit
def write_e4m3_rows(y, rows, cols, rows_ok, cols_ok, Q, Q_INV, D: tl.constexpr, WORDS: tl.constexpr = False,
                    ROWS: tl.constexpr = 1, BLOCK_D: tl.constexpr = 1):  # fmt: skip
    """Quantize the float32 tile ``y [ROWS, BLOCK_D]`` (its rows whole; ``rows_ok`` and ``cols_ok`` mask
    the real ones) into ``Q`` (bytes ``[num_rows, D]``, contiguous) and ``Q_INV`` (float32, one per
    row); returns the tile's column maxima of ``|y|`` as int32 bits (0 outside).

    ``WORDS`` (``D`` even; ``Q`` the bytes viewed as int16, :func:`as_words`): each pair of columns is
    stored as one 16-bit word (the even column in the low byte), the same bytes. A byte store makes
    Triton lay the tile out 16 values a thread, and the kernel's row sums follow: the norm-gate forward
    compiled for sm_90 (``compile_report.compile_producer``, row strides divisible by 16 as the JIT sees
    them at d = 1024) sums its rows over that layout where the kernel without rows sums over another (so
    ``y`` may differ in its last bit), with 34 CTA barriers against 13. Stored as words, it keeps the plain
    kernel's sums (``y`` bit-equal on the H200, 2026-12-04), with 20."""
    inside = rows_ok[:, None] & cols_ok[None, :]
    bits = tl.where(inside, abs_bits(y), 0)
    scale, scale_inv, nonfinite = pow2_scale(tl.max(bits, 1))
    q = tl.where(nonfinite[:, None], NAN_BYTE, e4m3_bits(y * scale[:, None]))
    if WORDS:
        even, odd = tl.split(q.reshape(ROWS, BLOCK_D // 2, 2))
        half = tl.arange(0, BLOCK_D // 2)
        tl.store(Q + rows[:, None] * (D // 2) + half[None, :], (even | (odd << 8)).to(tl.int16),
                 mask=rows_ok[:, None] & (half < D // 2)[None, :])  # fmt: skip
    else:
        tl.store(Q + rows[:, None] * D + cols[None, :], q.to(tl.uint8), mask=inside)
    tl.store(Q_INV + rows, scale_inv, mask=rows_ok)
    return tl.max(bits, 0)


@triton.jit
def load_rows(X, SCALE_INV, rows, cols, rows_ok, inside, stride_x, E4M3: tl.constexpr):
    """A ``[rows, cols]`` tile of ``X`` in fp32: as stored, or (``E4M3``) from e4m3 row bytes, each row
    times its ``SCALE_INV`` (the rows :func:`write_e4m3_rows` and the fused gap's saved format keep).
    Masked-out elements are 0."""
    if E4M3:
        z = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0)
        z = z.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return z * tl.load(SCALE_INV + rows, mask=rows_ok, other=1.0)[:, None]
    return tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)


@triton.jit
def load_e4m3_pairs(X, SCALE_INV, rows, rows_ok, stride_words, D: tl.constexpr, BLOCK_D: tl.constexpr,
                    ROWS: tl.constexpr):  # fmt: skip
    """A ``[ROWS, BLOCK_D]`` fp32 tile of e4m3 row bytes, each row times its ``SCALE_INV``, read as 16-bit
    words: ``X`` is the bytes viewed as int16 (``D`` and the row stride even; ``stride_words`` in words),
    each word split into its two bytes (little-endian: the low byte is the even column) and the pairs
    joined back in column order. Columns from ``D`` on are 0.

    Why words: a 1-byte tile loaded as such gets 16 values a thread, where the 16-bit tiles beside it in
    a loop get 8, and Triton converts between the two layouts through shared memory at every tile (the
    norm-gate backward compiled for sm_90: 53 CTA barriers against 15, and 3.8x slower on the H200).
    Words load 4 a thread, and the joined pairs come back as 8 a thread, the other tiles' layout."""
    half = tl.arange(0, BLOCK_D // 2)
    ok = rows_ok[:, None] & (half < D // 2)[None, :]
    w = tl.load(X + rows[:, None] * stride_words + half[None, :], mask=ok, other=0)
    pairs = tl.join((w & 0xFF).to(tl.uint8), ((w >> 8) & 0xFF).to(tl.uint8)).reshape(ROWS, BLOCK_D)
    z = pairs.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return z * tl.load(SCALE_INV + rows, mask=rows_ok, other=1.0)[:, None]


def as_words(data: torch.Tensor) -> torch.Tensor:
    """e4m3 rows ``[L, D]`` (unit column stride; ``D``, the row stride and the offset even) as the int16
    words :func:`load_e4m3_pairs` reads."""
    if data.shape[1] % 2 or data.stride(0) % 2 or data.storage_offset() % 2 or data.stride(1) != 1:
        raise ValueError(f"e4m3 rows read as words need an even width, row stride and offset, and unit column "
                         f"stride; got shape {tuple(data.shape)}, strides {data.stride()}, offset {data.storage_offset()}")  # fmt: skip
    return data.view(torch.uint8).view(torch.int16)


@triton.jit
def _dequantize(Q, SCALE_INV, OUT, stride_out, num_rows, width, ROWS: tl.constexpr, COLS: tl.constexpr,
                INTERP: tl.constexpr):  # fmt: skip
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    rows_ok = rows < num_rows
    inside = rows_ok[:, None] & (cols < width)[None, :]
    x = load_rows(Q, SCALE_INV, rows, cols, rows_ok, inside, width, True)
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], cast(x, OUT.dtype.element_ty, INTERP), mask=inside)


DEQUANTIZE_TILE = (4, 64) if INTERPRET else (16, 256)


def dequantize_rows(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data * scale_inv[:, None]`` in ``dtype`` (exact in bf16 and float32): e4m3 rows ``[L, W]``
    (contiguous, float8_e4m3fn or their bytes) with one float32 ``scale_inv`` per row."""
    num_rows, width = data.shape
    out = torch.empty((num_rows, width), dtype=dtype, device=data.device)
    rows, cols = DEQUANTIZE_TILE
    if num_rows:
        with device_guard(data.device):
            _dequantize[(triton.cdiv(num_rows, rows), triton.cdiv(width, cols))](
                data.view(torch.uint8), scale_inv, out, out.stride(0), num_rows, width, ROWS=rows, COLS=cols,
                INTERP=INTERPRET, num_warps=4,
            )  # fmt: skip
    return out


@dataclass(frozen=True)
class RowsOut:
    """The buffers a producer writes its quantized rows into (``None`` parts: not asked for)."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    column_amax_bits: torch.Tensor | None

    @staticmethod
    def allocate(num_rows: int, dim: int, device: torch.device, wanted: RowQuantization) -> RowsOut:
        return RowsOut(
            torch.empty((num_rows, dim), dtype=torch.uint8, device=device),
            torch.empty(num_rows, dtype=torch.float32, device=device),
            torch.zeros(dim, dtype=torch.int32, device=device) if wanted.column_amax else None,
        )

    def kernel_args(self, words: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's ``Q, Q_INV, COL_AMAX`` (without column maxima ``COL_AMAX`` is never written);
        ``words``: ``Q`` as the int16 words :func:`write_e4m3_rows` stores with ``WORDS``."""
        data = as_words(self.data) if words else self.data
        return data, self.scale_inv, self.scale_inv if self.column_amax_bits is None else self.column_amax_bits

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.data, self.scale_inv, self.column_amax_bits) if t is not None)

    def result(self) -> PrequantizedRows:
        return PrequantizedRows(self.data.view(RowQuantization.DTYPE), self.scale_inv, self.column_amax_bits)


def tiles_per_program(rows_per_tile: int, out: RowsOut | None) -> int:
    """Row tiles a producer's program runs: one, or with column maxima enough for few atomics per column."""
    if out is None or out.column_amax_bits is None:
        return 1
    return triton.cdiv(ROWS_PER_PROGRAM_WITH_COLUMNS, rows_per_tile)
