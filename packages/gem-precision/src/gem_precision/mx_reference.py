"""MXFP8 (OCP Microscaling Formats spec v1.0) quantize and dequantize in pure torch: the reference.

Layout. An :class:`MXTensor` is a GEMM operand ``[rows, k]`` whose blocks are 32 consecutive
elements along ``k`` (the reduction dimension, contiguous). ``data`` is float8_e4m3fn ``[rows, k]``;
``scale`` is float8_e8m0fnu ``[rows, ceil(k / 32)]``; element ``(r, c)`` stands for
``data[r, c] * 2**(scale[r, c // 32] - 127)``. To quantize along the other dimension of a tensor
(the transposed operands of the backward GEMMs) use ``axis=0``: the result is the operand for
``x.T``, shape ``[cols, rows]``.

Per block, as the spec says:
- scale exponent ``E = floor(log2(amax)) - 8`` (8 = emax of e4m3), clamped to [-127, 127];
- elements ``x / 2**E`` rounded to nearest even and saturated to +-448 (the largest |element| before
  saturation is below 512, so only values in [448, 512) * 2**E saturate);
- an all-zero block gets the smallest scale, 2**-127 (byte 0); a block whose amax is a subnormal
  also gets it (floor(log2) < -127 is clamped).

Choices the spec leaves open, made here:
- NaN or +-inf anywhere in a block: the scale is the NaN scale (byte 0xFF) and every element of the
  block is NaN (byte 0x7F). Infinity is not saturated: e4m3 has no infinity, and turning an overflow
  into 448 * 2**E would hide it from the non-finite-loss check. Dequantizing gives NaN for the block.
- A ``k`` that is not a multiple of 32: the last block is zero-padded to 32 elements before its amax
  is taken (zeros never change an amax), ``data`` keeps the logical shape ``[rows, k]`` and the scale
  has ``ceil(k / 32)`` columns. GEMM kernels read the missing elements as zeros.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gem_precision.formats import E4M3, FP8_NAN_BITS, exact_pow2

MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF
MX_SCALE_MIN_EXP = -127
MX_SCALE_MAX_EXP = 127


@dataclass(frozen=True)
class MXTensor:
    """An MXFP8 operand: e4m3 ``data [rows, k]`` and e8m0 ``scale [rows, ceil(k/32)]``."""

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self) -> None:
        if self.data.dim() != 2 or self.scale.dim() != 2:
            raise ValueError(f"MXTensor: data and scale must be 2-d, got {self.data.shape}, {self.scale.shape}")
        rows, k = self.data.shape
        if tuple(self.scale.shape) != (rows, -(-k // MX_BLOCK)):
            raise ValueError(
                f"MXTensor: scale shape {tuple(self.scale.shape)} does not fit data shape {(rows, k)}; "
                f"expected {(rows, -(-k // MX_BLOCK))}"
            )

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data, self.scale

    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel()


def mx_scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """int32 block scale exponent ``clamp(floor(log2 amax) - 8, -127, 127)`` (-127 for amax = 0)."""
    _, exponent = torch.frexp(amax)  # amax = m * 2**exponent with m in [0.5, 1)
    floor_log2 = torch.where(amax > 0, exponent - 1, torch.full_like(exponent, MX_SCALE_MIN_EXP))
    return (floor_log2 - E4M3.emax).clamp(MX_SCALE_MIN_EXP, MX_SCALE_MAX_EXP).to(torch.int32)


def mx_quantize(x: torch.Tensor, *, axis: int = -1) -> MXTensor:
    """Quantize a 2-d tensor with blocks along ``axis`` (-1/1: along rows; 0: operand of ``x.T``)."""
    if x.dim() != 2:
        raise ValueError(f"mx_quantize: expected a 2-d tensor, got shape {tuple(x.shape)}")
    if axis not in (-1, 0, 1):
        raise ValueError(f"mx_quantize: axis must be -1, 0 or 1, got {axis}")
    xf = (x.t() if axis == 0 else x).float()
    rows, k = xf.shape
    n_blocks = -(-k // MX_BLOCK)
    blocks = F.pad(xf, (0, n_blocks * MX_BLOCK - k)).view(rows, n_blocks, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)  # NaN propagates through amax
    nonfinite = ~torch.isfinite(amax)
    exponent = mx_scale_exponent(amax)
    # exponent lies in [-127, 119] for any finite float32 amax, so 2**-exponent is a normal float32
    # and the division below is an exact multiply; the cast rounds to nearest even.
    scaled = blocks * exact_pow2(-exponent.clamp(max=126))[..., None]
    elements = scaled.clamp(-E4M3.max, E4M3.max).to(torch.float8_e4m3fn).view(torch.uint8)
    elements = torch.where(nonfinite[..., None], torch.tensor(FP8_NAN_BITS, dtype=torch.uint8), elements)
    scale = torch.where(nonfinite, E8M0_NAN, exponent + E8M0_BIAS).to(torch.uint8)
    data = elements.view(rows, n_blocks * MX_BLOCK)[:, :k].contiguous()
    return MXTensor(data.view(torch.float8_e4m3fn), scale.view(torch.float8_e8m0fnu))


def e8m0_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """2**(byte - 127) as float32 (byte 0 is the subnormal 2**-127, byte 255 is NaN)."""
    return scale.view(torch.float8_e8m0fnu).to(torch.float32)


def mx_dequantize(mx: MXTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``data * 2**scale`` as ``dtype`` (exact in float32; in bfloat16 too, both have 8 exponent bits)."""
    rows, k = mx.data.shape
    n_blocks = mx.scale.shape[1]
    values = F.pad(mx.data.float(), (0, n_blocks * MX_BLOCK - k)).view(rows, n_blocks, MX_BLOCK)
    out = (values * e8m0_to_float32(mx.scale)[..., None]).view(rows, n_blocks * MX_BLOCK)[:, :k]
    return out.to(dtype)


def mx_gemm_reference(a: MXTensor, b: MXTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``dequantize(a) @ dequantize(b).T`` in float32: what every MX GEMM must reproduce."""
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"mx_gemm_reference: reduction dims differ: a {tuple(a.shape)}, b {tuple(b.shape)}")
    return (mx_dequantize(a) @ mx_dequantize(b).t()).to(out_dtype)
