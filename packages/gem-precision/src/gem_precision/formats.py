"""The fp8 element formats and the exact power-of-two arithmetic every scheme shares.

All scales in this package are powers of two. Multiplying by one is exact (no rounding beyond the
final cast to fp8), so the pure-torch references and the Triton kernels produce the same bits, and a
scale can be stored as an exponent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

Fp8FormatName = Literal["e4m3", "e5m2"]


@dataclass(frozen=True)
class Fp8Format:
    """An OCP fp8 element format, as torch and Triton name it."""

    name: Fp8FormatName
    dtype: torch.dtype
    max: float
    """Largest finite value: 448 (e4m3) or 57344 (e5m2), both 1.75 * 2**emax."""
    emax: int
    """Exponent of ``max``: 8 (e4m3) or 15 (e5m2)."""
    mbits: int
    """Mantissa bits: 3 (e4m3) or 2 (e5m2)."""
    min_normal: float
    """Smallest normal: 2**-6 (e4m3) or 2**-14 (e5m2); below it the spacing is fixed."""
    triton_name: str
    """The ``triton.language`` dtype: ``float8e4nv`` (e4m3fn) or ``float8e5``."""

    @property
    def subnormal_magic(self) -> float:
        """1.5 * 2**(23 + log2(spacing below min_normal)): adding then subtracting it rounds a small
        fp32 value to that spacing with round-to-nearest-even (used by the software rounding)."""
        spacing_exp = round(math.log2(self.min_normal)) - self.mbits
        return 1.5 * 2.0 ** (23 + spacing_exp)


E4M3 = Fp8Format("e4m3", torch.float8_e4m3fn, 448.0, 8, 3, 2.0**-6, "float8e4nv")
E5M2 = Fp8Format("e5m2", torch.float8_e5m2, 57344.0, 15, 2, 2.0**-14, "float8e5")
FORMATS: dict[str, Fp8Format] = {"e4m3": E4M3, "e5m2": E5M2}

FP8_NAN_BITS = 0x7F
"""The byte written for every element of a non-finite scaling group (a NaN in e4m3fn and e5m2)."""
FP32_NAN_BITS = 0x7FC00000
"""The float32 dequantization factor of a non-finite group, written as these bits by the kernels and
the references alike (a NaN made by arithmetic may carry another payload on some devices)."""


def fp8_format(name: str) -> Fp8Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown fp8 format {name!r}; allowed: {sorted(FORMATS)}") from None


def exact_pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` as float32, built from the bits so that no libm rounding is involved.

    ``exponent`` is an integer tensor in the normal range [-126, 127].
    """
    if exponent.numel() and (int(exponent.min()) < -126 or int(exponent.max()) > 127):
        raise ValueError(
            f"exact_pow2: exponents must lie in [-126, 127]; got [{int(exponent.min())}, {int(exponent.max())}]"
        )
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def abs_bits(x: torch.Tensor) -> torch.Tensor:
    """|x| of a float32 tensor as int32 bit patterns: ordered like the values, and NaN (any
    payload) compares greater than +inf, so an integer max propagates NaN deterministically."""
    return x.view(torch.int32) & 0x7FFFFFFF
