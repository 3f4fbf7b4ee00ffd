"""Triton helpers shared by the quantization kernels. Importing this module imports Triton.

Rounding to fp8. On NVIDIA GPUs Triton lowers a float32 -> fp8 cast to ``cvt.rn.satfinite``: round to
nearest even, as torch does. Triton's interpreter (``TRITON_INTERPRET=1``) does not: it rounds ties
away from zero and mishandles the subnormal range (measured with triton 3.7). Kernels therefore take
a ``SOFTWARE_ROUND`` flag: when set, values are first rounded onto the fp8 grid with integer and
float32 operations (exact, round to nearest even), so the cast that follows is exact whatever its
rounding. It is set under the interpreter (:func:`software_rounding_default`) and can be forced on a
GPU; the benchmark checks both settings bit for bit against the torch references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_precision.device import triton_interpreting as interpreting
from gem_precision.formats import Fp8Format


def software_rounding_default() -> bool:
    return interpreting()


def check_triton_device(t: torch.Tensor, what: str) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if t.device.type == "cuda" or (t.device.type == "cpu" and interpreting()):
        return
    raise RuntimeError(
        f"{what}: Triton kernels need a CUDA tensor (or TRITON_INTERPRET=1 for CPU tensors); got a tensor on {t.device}"
    )


def fp8_kernel_constants(fmt: Fp8Format) -> dict[str, object]:
    """The constexpr arguments that describe ``fmt`` to :func:`cast_to_fp8_bits`."""
    return {
        "FP8_E5M2": fmt.name == "e5m2",
        "EMAX": fmt.emax,
        "MBITS": fmt.mbits,
        "MIN_NORMAL": fmt.min_normal,
        "MAGIC": fmt.subnormal_magic,
    }


@triton.jit
def abs_bits(x):
    """|x| (float32) as int32 bits: integer max orders them like values, with NaN above +inf."""
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def round_to_fp8_grid(v, MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr):
    """Round finite float32 ``v`` (|v| <= fp8 max) to the nearest fp8 value, ties to even."""
    b = v.to(tl.int32, bitcast=True)
    # Normal range: round the float32 mantissa to MBITS bits (a carry correctly bumps the exponent).
    lsb = (b >> (23 - MBITS)) & 1
    rounded = (b + ((1 << (22 - MBITS)) - 1) + lsb) & (-(1 << (23 - MBITS)))
    normal = rounded.to(tl.float32, bitcast=True)
    # Subnormal range: the spacing is fixed; adding 1.5 * 2**k rounds to it in float32 hardware.
    sub = (v + MAGIC) - MAGIC
    sign = (b >> 31) << 31  # keeps -0.0 for tiny negatives, which round to zero
    sub = (sub.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < MIN_NORMAL, sub, normal)


@triton.jit
def cast_to_fp8_bits(
    v,
    FP8_E5M2: tl.constexpr,
    MBITS: tl.constexpr,
    MIN_NORMAL: tl.constexpr,
    MAGIC: tl.constexpr,
    SOFTWARE_ROUND: tl.constexpr,
):
    """float32 ``v`` (already within the fp8 range) -> fp8 bit patterns as uint8."""
    if SOFTWARE_ROUND:
        v = round_to_fp8_grid(v, MBITS, MIN_NORMAL, MAGIC)
    if FP8_E5M2:
        q = v.to(tl.float8e5)
    else:
        q = v.to(tl.float8e4nv)
    return q.to(tl.uint8, bitcast=True)


@triton.jit
def pow2_from_biased(biased):
    """2**(biased - 127) as float32 from an int32 biased exponent in [1, 254]."""
    return (biased << 23).to(tl.float32, bitcast=True)


@triton.jit
def e8m0_to_float(code):
    """An e8m0 byte (as int32) -> float32: 2**(code - 127); 0 -> 2**-127 (subnormal), 255 -> NaN."""
    bits = tl.where(code == 0, 0x00400000, code << 23)
    bits = tl.where(code == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def pow2_scale(amax_bits, EMAX: tl.constexpr):
    """(2**s, 2**-s, non-finite) with s the largest integer such that amax * 2**s <= fp8 max."""
    floor_log2 = (amax_bits >> 23) - 127
    s = EMAX - floor_log2 - ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # max = 1.75 * 2**EMAX
    s = tl.minimum(tl.maximum(s, -126), 126)
    nonfinite = amax_bits >= 0x7F800000
    # NaN as explicit bits (formats.FP32_NAN_BITS), the same payload the reference writes
    scale = tl.where(nonfinite, 0x7FC00000, (127 + s) << 23).to(tl.float32, bitcast=True)
    scale_inv = tl.where(nonfinite, 0x7FC00000, (127 - s) << 23).to(tl.float32, bitcast=True)
    return scale, scale_inv, nonfinite
