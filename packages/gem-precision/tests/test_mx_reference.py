"""The MX reference against an independent scalar reading of the OCP MX v1.0 spec (pure Python)."""

from __future__ import annotations

import math

import pytest
import torch

from gem_precision.mx_reference import MX_BLOCK, MXTensor, mx_dequantize, mx_gemm_reference, mx_quantize
from gem_precision.testing import mx_edge_cases, raw_bytes, rel_err, wide_range_randn

E4M3_CODES = [
    (code, float(v))
    for code, v in enumerate(torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist())
]


def encode_e4m3(v: float) -> int:
    """Round to the nearest e4m3 value, ties to the even code (the mantissa's last bit), saturating."""
    mag = min(abs(v), 448.0)
    best = min(E4M3_CODES, key=lambda cv: (abs(cv[1] - mag), cv[0] & 1))[0]
    return best | (0x80 if math.copysign(1.0, v) < 0 else 0)


def spec_block(values: list[float]) -> tuple[int, list[int]]:
    """(scale byte, element bytes) of one block, straight from the spec text."""
    if any(math.isnan(v) or math.isinf(v) for v in values):
        return 0xFF, [0x7F] * len(values)
    amax = max(abs(v) for v in values)
    exp = -127 if amax == 0 else max(-127, min(127, math.floor(math.log2(amax)) - 8))
    return exp + 127, [encode_e4m3(v / 2.0**exp) for v in values]


def spec_quantize(x: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    scales, elements = [], []
    for row in x.tolist():
        s_row, e_row = [], []
        for start in range(0, len(row), MX_BLOCK):
            block = row[start : start + MX_BLOCK]
            scale, elems = spec_block(block + [0.0] * (MX_BLOCK - len(block)))
            s_row.append(scale)
            e_row += elems[: len(block)]
        scales.append(s_row)
        elements.append(e_row)
    return scales, elements


def assert_matches_spec(x: torch.Tensor) -> None:
    mx = mx_quantize(x)
    scales, elements = spec_quantize(x.float())
    assert raw_bytes(mx.scale).tolist() == scales
    assert raw_bytes(mx.data).tolist() == elements


@pytest.mark.parametrize("name", sorted(mx_edge_cases()))
def test_edge_cases_match_the_spec(name: str) -> None:
    assert_matches_spec(mx_edge_cases()[name])


def test_random_data_matches_the_spec(gen: torch.Generator) -> None:
    assert_matches_spec(wide_range_randn(6, 96, generator=gen))
    assert_matches_spec(torch.randn(3, 77, generator=gen).bfloat16())


def test_documented_edge_values() -> None:
    x = torch.zeros(6, 32)
    x[1, 0] = 1e-40  # subnormal amax: floor(log2) < -127 clamps to the smallest scale
    x[2, :3] = torch.tensor([511.0, 1.0, -600.0])  # amax 600: exp 1; 255.5 -> 256, 300 -> 288 (spacing 32)
    x[3, 5] = float("inf")
    x[4, 7] = float("-inf")
    x[5, 9] = float("nan")
    mx = mx_quantize(x)
    assert raw_bytes(mx.scale)[:, 0].tolist() == [0, 0, 128, 0xFF, 0xFF, 0xFF]
    assert mx.data[2, :3].float().tolist() == [256.0, 0.5, -288.0]
    assert (raw_bytes(mx.data[3:]) == 0x7F).all()
    deq = mx_dequantize(mx)
    assert deq[3:].isnan().all() and not deq[:3].isnan().any()
    # a value 448 * 2**k + something saturates to 448 * 2**k
    y = torch.full((1, 32), 2.0**10)
    y[0, 0] = 2.0**10 * 1.99
    assert mx_dequantize(mx_quantize(y))[0, 0].item() == 448.0 * 2.0**2


def test_ragged_reduction_dim_is_zero_padded(gen: torch.Generator) -> None:
    x = torch.randn(4, 45, generator=gen)
    mx = mx_quantize(x)
    assert mx.data.shape == (4, 45) and mx.scale.shape == (4, 2)
    padded = mx_quantize(torch.nn.functional.pad(x, (0, 19)))
    assert torch.equal(raw_bytes(padded.data)[:, :45], raw_bytes(mx.data))
    assert torch.equal(raw_bytes(padded.scale), raw_bytes(mx.scale))


def test_axis0_is_the_transposed_operand(gen: torch.Generator) -> None:
    x = torch.randn(70, 40, generator=gen)
    a, b = mx_quantize(x, axis=0), mx_quantize(x.t().contiguous())
    assert a.shape == (40, 70)
    assert torch.equal(raw_bytes(a.data), raw_bytes(b.data)) and torch.equal(raw_bytes(a.scale), raw_bytes(b.scale))


def test_dequantize_is_exact_and_error_is_bounded(gen: torch.Generator) -> None:
    x = torch.randn(8, 256, generator=gen)
    mx = mx_quantize(x)
    deq = mx_dequantize(mx)
    assert torch.equal(mx_dequantize(mx, torch.bfloat16).float(), deq)  # e4m3 * 2**k fits bfloat16
    # round to nearest with 3 mantissa bits: |error| <= 2**-4 |x|, plus saturation and the subnormal floor
    err = (deq - x).abs()
    block_amax = x.abs().view(8, 8, 32).amax(-1).repeat_interleave(32, dim=1)
    assert (
        err
        <= x.abs() * 2.0**-4
        + block_amax * 2.0**-9
        + (x.abs() - 448 * 2.0 ** (block_amax.log2().floor() - 8)).clamp(min=0)
    ).all()


def test_gemm_reference_and_shape_checks(gen: torch.Generator) -> None:
    a, b = mx_quantize(torch.randn(5, 64, generator=gen)), mx_quantize(torch.randn(3, 64, generator=gen))
    assert rel_err(mx_gemm_reference(a, b), mx_dequantize(a) @ mx_dequantize(b).t()) == 0
    with pytest.raises(ValueError, match="reduction dims differ"):
        mx_gemm_reference(a, mx_quantize(torch.randn(3, 32)))
    with pytest.raises(ValueError, match="does not fit"):
        MXTensor(a.data, a.scale[:, :1])
    with pytest.raises(ValueError, match="2-d"):
        mx_quantize(torch.zeros(2, 2, 32))
