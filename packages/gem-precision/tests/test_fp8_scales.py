"""fp8 scale choice at the corners (powers of two, 1.75 * 2**k, subnormal and non-finite amaxes), and
bit-for-bit agreement of the fused kernels with the reference including the float32 scale bits
(NaN payloads too): what the GPU benchmark compares, which the value-based tests did not."""

from __future__ import annotations

import math

import pytest
import torch

from gem_precision.checks import compare_bits, compare_operands, summarize
from gem_precision.formats import E4M3, E5M2, FP32_NAN_BITS, Fp8Format
from gem_precision.fp8_quant_triton import quantize_fp8_triton
from gem_precision.fp8_reference import quantize_fp8_reference, scale_exponent
from gem_precision.testing import mx_edge_cases

FORMATS = [E4M3, E5M2]


def corner_amaxes() -> list[float]:
    """2**k, its float32 neighbours, and 1.75 * 2**k with its neighbours, for every float32 binade."""
    out: list[float] = [0.0, 2.0**-149, 2.0**-140, 1e-40, 2.0**-126 * (1 - 2.0**-23)]
    for k in range(-126, 128):
        for base in (2.0**k, 1.75 * 2.0**k):
            f = torch.tensor([base], dtype=torch.float32)
            out += [
                base,
                torch.nextafter(f, torch.tensor([0.0])).item(),
                torch.nextafter(f, torch.tensor([math.inf])).item(),
            ]
    return [v for v in out if math.isfinite(v) and v < 3.4028234663852886e38]


def scalar_exponent(amax: float, fmt: Fp8Format) -> int:
    """The definition, in exact Python arithmetic: the largest s in [-126, 126] with amax * 2**s <= max."""
    if amax == 0:
        return 126
    return max(-126, min(126, max(s for s in range(-300, 300) if math.ldexp(amax, s) <= fmt.max)))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_scale_exponent_at_powers_of_two(fmt: Fp8Format) -> None:
    amax = corner_amaxes()
    got = scale_exponent(torch.tensor(amax, dtype=torch.float32), fmt).tolist()
    wrong = [(a, g, scalar_exponent(a, fmt)) for a, g in zip(amax, got) if g != scalar_exponent(a, fmt)]
    assert not wrong, wrong[:5]


def test_nonfinite_scale_is_the_fixed_nan_bits() -> None:
    x = torch.tensor([[1.0, float("inf")], [float("nan"), 2.0], [-float("inf"), 3.0], [0.5, 0.25]])
    op = quantize_fp8_reference(x, granularity="row", fmt=E4M3).rows
    assert op is not None
    assert op.scale_inv.view(torch.int32).flatten()[:3].tolist() == [FP32_NAN_BITS] * 3


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_kernel_scales_at_powers_of_two_bit_identical(fmt: Fp8Format, granularity: str) -> None:
    # one row per corner amax (row scales), and the same rows transposed (column scales)
    amax = torch.tensor(corner_amaxes(), dtype=torch.float32)
    x = (torch.linspace(-1, 1, 32)[None, :] * amax[:, None]).contiguous()
    x[:, 7] = amax  # the amax itself sits in every row
    kwargs = {"granularity": granularity, "fmt": fmt, "rows": True, "cols_t": True, "pad_to": 16}
    got, want = quantize_fp8_triton(x, **kwargs), quantize_fp8_reference(x, **kwargs)
    diffs = compare_operands("rows", got.rows, want.rows, source=x)
    diffs += compare_operands("cols_t", got.cols_t, want.cols_t, source=x)
    assert not diffs, summarize(diffs)


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("name", sorted(n for n, t in mx_edge_cases().items() if t.shape[0] > 1))
def test_edge_cases_bit_identical_with_scale_bits(name: str, granularity: str) -> None:
    """The benchmark's own check (including the scale's bits, NaN payloads too), on CPU."""
    x = mx_edge_cases()[name]
    kwargs = {"granularity": granularity, "fmt": E4M3, "rows": True, "cols_t": True, "pad_to": 16}
    got, want = quantize_fp8_triton(x, **kwargs), quantize_fp8_reference(x, **kwargs)
    diffs = compare_operands("rows", got.rows, want.rows, source=x)
    diffs += compare_operands("cols_t", got.cols_t, want.cols_t, source=x)
    assert not diffs, summarize(diffs)


def test_compare_bits_reports_what_differs() -> None:
    want = torch.tensor([[1.0, 2.0], [3.0, float("nan")]]).to(torch.float8_e4m3fn)
    got = want.clone()
    got.view(torch.uint8)[0, 1] += 1
    d = compare_bits("data", got, want, source=torch.tensor([[1.0, 2.1], [3.0, 0.0]]))
    assert d is not None and d["mismatches"] == 1 and d["examples"][0]["index"] == [0, 1]
    assert d["examples"][0]["input"] == pytest.approx(2.1) and d["max_abs_diff"] == pytest.approx(0.25)
    assert compare_bits("data", want, want.clone()) is None
