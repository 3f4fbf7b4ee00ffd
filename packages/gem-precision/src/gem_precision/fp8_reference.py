"""Dynamic fp8 scaling (tensorwise and rowwise) in pure torch: the numerics every backend reproduces.

Scale choice. A scaling group (the whole tensor, or one row) with ``amax = max |x|`` gets the scale
``2**s`` with ``s`` the largest integer such that ``amax * 2**s <= fmt.max`` (clamped to
[-126, 126] so that both ``2**s`` and ``2**-s`` are normal float32). Compared with the usual
``fmt.max / amax`` this gives up at most one bit of range, and buys exactness: scaling is a
power-of-two multiply, so the only rounding is the final cast (round to nearest even), and the
Triton kernels reproduce these bits exactly. Because ``|x| * 2**s <= fmt.max`` holds by construction,
no value ever saturates.

Non-finite values. A group that contains a NaN or an infinity is marked non-finite: its elements are
all written as NaN (byte 0x7F) and its dequantization factor is NaN, so the GEMM output of that row
or column is NaN and the trainer's non-finite-loss check stops the run. Saturating an infinity to
``fmt.max`` would instead hide an overflow as a plausible number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gem_precision.formats import FP8_NAN_BITS, FP32_NAN_BITS, Fp8Format, abs_bits, exact_pow2

Granularity = Literal["tensor", "row"]
_MAX_FRACTION_BITS = 0x600000  # the fraction field of 1.75, the mantissa of both e4m3 and e5m2 maxima


@dataclass(frozen=True)
class Fp8Operand:
    """A GEMM operand ``[rows, k]`` in fp8 (k contiguous) and its dequantization factor.

    ``scale_inv`` is ``[rows, 1]`` (one per row) or a 0-d tensor (one per tensor); the real value is
    ``data * scale_inv``. Columns past the logical k (padding for ``torch._scaled_mm``) are zeros.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale_inv).to(dtype)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data, self.scale_inv


@dataclass(frozen=True)
class Fp8Pair:
    """What one quantization of a 2-d tensor ``x [M, N]`` produces, each part only when asked for.

    ``rows``: ``x`` itself, quantized per row (or per tensor), ``[M, N]``.
    ``cols_t``: ``x.T``, quantized per column of ``x`` (or per tensor), ``[N, M_pad]`` row-major,
    i.e. the transposed operand of a backward GEMM that reduces over ``M``.
    ``col_sum``: float32 ``x.sum(0)`` (a bias gradient), from the same read on the fused path.
    """

    rows: Fp8Operand | None
    cols_t: Fp8Operand | None
    col_sum: torch.Tensor | None = None


def scale_exponent(amax: torch.Tensor, fmt: Fp8Format) -> torch.Tensor:
    """int32 ``s``: the largest integer with ``amax * 2**s <= fmt.max``, clamped to [-126, 126].

    Computed from the float32 bits with integer operations, exactly as the Triton kernels do
    (``fp8_quant_triton._pow2_scale``), not with ``frexp``/``log2`` from a math library: the same
    formula on CPU, on CUDA and in the kernel, so the reference cannot drift from the kernel on a
    device whose libm (or flush-to-zero mode) treats a corner differently. For a subnormal amax the
    biased exponent field is 0, so ``s`` comes out >= 134 and clamps to 126, as does amax = 0;
    for NaN/inf the group is marked non-finite anyway.
    """
    bits = abs_bits(amax.float().contiguous())
    floor_log2 = (bits >> 23) - 127
    # fmt.max = 1.75 * 2**emax: a mantissa above 1.75 (fraction bits > 0x600000) costs one more bit
    above = ((bits & 0x7FFFFF) > _MAX_FRACTION_BITS).to(torch.int32)
    return (fmt.emax - floor_log2 - above).clamp(-126, 126).to(torch.int32)


def _quantize_groups(x: torch.Tensor, amax: torch.Tensor, fmt: Fp8Format) -> Fp8Operand:
    """Quantize float32 ``x`` with one group per entry of ``amax`` (broadcast against ``x``)."""
    s = scale_exponent(amax, fmt)
    nonfinite = ~torch.isfinite(amax)
    q = (x * exact_pow2(s)).to(fmt.dtype)
    bits = torch.where(nonfinite, torch.tensor(FP8_NAN_BITS, dtype=torch.uint8), q.view(torch.uint8))
    nan = torch.tensor(FP32_NAN_BITS, dtype=torch.int32).view(torch.float32)
    scale_inv = torch.where(nonfinite, nan, exact_pow2(-s))
    return Fp8Operand(bits.view(fmt.dtype), scale_inv)


def check_col_amax_bits(bits: torch.Tensor | None, x: torch.Tensor, granularity: Granularity, where: str) -> None:
    """Column maxima handed to a quantizer must be int32 ``[N]`` bits on ``x``'s device, for row scales."""
    if bits is None:
        return
    if granularity != "row":
        raise ValueError(f"{where}: col_amax_bits are column scales' maxima; granularity {granularity!r} has none")
    if bits.dtype != torch.int32 or bits.shape != (x.shape[1],) or bits.device != x.device:
        raise ValueError(
            f"{where}: col_amax_bits must be int32 [{x.shape[1]}] on {x.device}, got {bits.dtype} "
            f"{tuple(bits.shape)} on {bits.device}"
        )


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def quantize_fp8_reference(
    x: torch.Tensor,
    *,
    granularity: Granularity,
    fmt: Fp8Format,
    rows: bool = True,
    cols_t: bool = False,
    col_sum: bool = False,
    pad_to: int = 1,
    col_amax_bits: torch.Tensor | None = None,
) -> Fp8Pair:
    """Quantize a 2-d tensor ``x [M, N]``; see :class:`Fp8Pair`. ``pad_to`` rounds ``M_pad`` up.
    ``col_amax_bits``: the column maxima of ``|x|`` as int32 bits, computed elsewhere (by the kernel
    that produced ``x``: ``gem_model.api.PrequantizedRows``); ``cols_t`` then takes its scales from
    them instead of from ``x`` (row granularity only)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_reference: expected a 2-d tensor, got shape {tuple(x.shape)}")
    if granularity not in ("tensor", "row"):
        raise ValueError(f"quantize_fp8_reference: granularity must be 'tensor' or 'row', got {granularity!r}")
    check_col_amax_bits(col_amax_bits, x, granularity, "quantize_fp8_reference")
    xf = x.float()
    m = xf.shape[0]
    tensor_amax = xf.abs().amax() if granularity == "tensor" else None
    rows_op = cols_op = None
    if rows:
        amax = tensor_amax if tensor_amax is not None else xf.abs().amax(dim=1, keepdim=True)
        rows_op = _quantize_groups(xf, amax, fmt)
    if cols_t:
        if col_amax_bits is not None:
            amax = col_amax_bits.view(torch.float32)[:, None]
        else:
            amax = tensor_amax if tensor_amax is not None else xf.abs().amax(dim=0)[:, None]
        op = _quantize_groups(xf.t(), amax, fmt)
        pad = round_up(m, pad_to) - m
        data = op.data.view(torch.uint8)
        data = torch.nn.functional.pad(data, (0, pad)) if pad else data.contiguous()
        cols_op = Fp8Operand(data.view(fmt.dtype), op.scale_inv)
    return Fp8Pair(rows_op, cols_op, xf.sum(dim=0) if col_sum else None)


def quantize_blocks_t_reference(x: torch.Tensor, fmt: Fp8Format, *, block: int = 128) -> Fp8Operand:
    """``x [M, N]`` transposed and quantized in blocks of ``block`` rows of one column: the operand of a
    weight-gradient GEMM that reduces over ``M`` (the tokens) with 1 x ``block`` scales (``torch``'s
    ``ScalingType.BlockWise1x128``, DeepSeek-V3's recipe for ``dW``). Each (column, block of rows) group
    gets its own power-of-two scale, so a kernel that holds ``block`` rows whole can write it in one pass,
    without the column's maximum over all rows.

    ``data`` is ``[N, M_pad]`` row-major (``M_pad`` = ``M`` rounded up to ``block``; the padding is
    zeros); ``scale_inv`` is ``[N, M_pad / block]`` with stride ``(1, N)``, the layout the GEMM reads
    ("outer-dim-major"); the real value of ``data[n, m]`` is ``data[n, m] * scale_inv[n, m // block]``.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_blocks_t_reference: expected a 2-d tensor, got shape {tuple(x.shape)}")
    if block < 1:
        raise ValueError(f"quantize_blocks_t_reference: block must be positive, got {block}")
    m, n = x.shape
    m_pad = round_up(m, block)
    xt = torch.nn.functional.pad(x.float().t(), (0, m_pad - m)).reshape(n, m_pad // block, block)
    op = _quantize_groups(xt, xt.abs().amax(dim=2, keepdim=True), fmt)
    data = op.data.reshape(n, m_pad)
    scale_inv = op.scale_inv.reshape(n, m_pad // block).t().contiguous().t()
    return Fp8Operand(data, scale_inv)
