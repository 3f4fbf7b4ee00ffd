"""Dynamic fp8 scaling: the reference against the scalar definition; the fused Triton kernels
(under TRITON_INTERPRET=1) bit-identical to the reference."""

from __future__ import annotations

import math

import pytest
import torch

from gem_precision.formats import E4M3, E5M2, Fp8Format
from gem_precision.fp8_quant_triton import quantize_fp8_triton
from gem_precision.fp8_reference import Fp8Operand, quantize_fp8_reference, scale_exponent
from gem_precision.testing import mx_edge_cases, raw_bytes, wide_range_randn

FORMATS = [E4M3, E5M2]


def codes(fmt: Fp8Format) -> list[tuple[int, float]]:
    values = torch.arange(128, dtype=torch.uint8).view(fmt.dtype).float().tolist()
    return [(c, v) for c, v in enumerate(values) if math.isfinite(v)]


def encode(v: float, fmt: Fp8Format) -> int:
    best = min(codes(fmt), key=lambda cv: (abs(cv[1] - abs(v)), cv[0] & 1))[0]
    return best | (0x80 if math.copysign(1.0, v) < 0 else 0)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_scale_is_the_largest_power_of_two_that_fits(fmt: Fp8Format, gen: torch.Generator) -> None:
    amax = torch.cat(
        [wide_range_randn(1, 500, generator=gen).abs().flatten(), torch.tensor([fmt.max, 1.0, 1.75, 1.76, 3e38])]
    )
    s = scale_exponent(amax, fmt)
    for a, e in zip(amax.tolist(), s.tolist()):
        assert a * 2.0**e <= fmt.max and (e == 126 or a * 2.0 ** (e + 1) > fmt.max), (a, e)
    assert scale_exponent(torch.tensor([0.0, 1e-40]), fmt).tolist() == [126, 126]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_rowwise_reference_matches_scalar_definition(fmt: Fp8Format, gen: torch.Generator) -> None:
    x = wide_range_randn(4, 24, generator=gen, spread=10)
    x[1, :] = 0
    x[2, 3] = float("nan")
    op = quantize_fp8_reference(x, granularity="row", fmt=fmt).rows
    assert op is not None
    for r, row in enumerate(x.tolist()):
        if any(math.isnan(v) for v in row):
            assert (raw_bytes(op.data[r]) == 0x7F).all() and op.scale_inv[r].isnan()
            continue
        amax = max(abs(v) for v in row)
        s = 126 if amax == 0 else max(e for e in range(-126, 127) if amax * 2.0**e <= fmt.max)
        assert op.scale_inv[r].item() == 2.0**-s
        assert raw_bytes(op.data[r]).tolist() == [encode(v * 2.0**s, fmt) for v in row]


def test_pair_layouts_and_padding(gen: torch.Generator) -> None:
    x = torch.randn(20, 48, generator=gen)
    pair = quantize_fp8_reference(x, granularity="row", fmt=E4M3, rows=True, cols_t=True, col_sum=True, pad_to=16)
    assert pair.rows is not None and pair.cols_t is not None and pair.col_sum is not None
    assert pair.rows.data.shape == (20, 48) and pair.rows.scale_inv.shape == (20, 1)
    assert pair.cols_t.data.shape == (48, 32) and pair.cols_t.scale_inv.shape == (48, 1)
    assert (raw_bytes(pair.cols_t.data[:, 20:]) == 0).all()
    again = quantize_fp8_reference(x.t().contiguous(), granularity="row", fmt=E4M3).rows
    assert again is not None and torch.equal(raw_bytes(pair.cols_t.data[:, :20]), raw_bytes(again.data))
    torch.testing.assert_close(pair.col_sum, x.sum(0))
    tensorwise = quantize_fp8_reference(x, granularity="tensor", fmt=E5M2, cols_t=True).rows
    assert tensorwise is not None and tensorwise.scale_inv.dim() == 0


def assert_same(got: Fp8Operand | None, want: Fp8Operand | None) -> None:
    assert got is not None and want is not None
    assert torch.equal(raw_bytes(got.data), raw_bytes(want.data))
    assert got.scale_inv.shape == want.scale_inv.shape
    torch.testing.assert_close(got.scale_inv, want.scale_inv, rtol=0, atol=0, equal_nan=True)


CASES = {name: t for name, t in mx_edge_cases().items() if t.shape[0] > 1}


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("name", sorted(CASES))
def test_triton_edge_cases_bit_identical(name: str, fmt: Fp8Format, granularity: str) -> None:
    x = CASES[name]
    kwargs = {"granularity": granularity, "fmt": fmt, "rows": True, "cols_t": True, "pad_to": 16}
    got, want = quantize_fp8_triton(x, **kwargs), quantize_fp8_reference(x, **kwargs)
    assert_same(got.rows, want.rows)
    assert_same(got.cols_t, want.cols_t)


@pytest.mark.parametrize("granularity", ["row", "tensor"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize(("shape", "dtype"), [((48, 64), torch.bfloat16), ((37, 50), torch.float32)])
def test_triton_random_bit_identical(gen: torch.Generator, shape, dtype, fmt: Fp8Format, granularity: str) -> None:
    x = wide_range_randn(*shape, generator=gen).to(dtype)
    kwargs = {"granularity": granularity, "fmt": fmt, "rows": True, "cols_t": True, "col_sum": True, "pad_to": 16}
    got, want = quantize_fp8_triton(x, **kwargs), quantize_fp8_reference(x, **kwargs)
    assert_same(got.rows, want.rows)
    assert_same(got.cols_t, want.cols_t)
    assert got.col_sum is not None and want.col_sum is not None
    torch.testing.assert_close(got.col_sum, want.col_sum, rtol=1e-5, atol=1e-5 * want.col_sum.abs().max().item())


@pytest.mark.parametrize(
    ("rows", "cols_t", "col_sum"), [(True, False, False), (False, True, True), (False, False, True)]
)
def test_triton_partial_requests(gen: torch.Generator, rows: bool, cols_t: bool, col_sum: bool) -> None:
    x = torch.randn(40, 48, generator=gen)
    kwargs = {"granularity": "row", "fmt": E4M3, "rows": rows, "cols_t": cols_t, "col_sum": col_sum}
    got, want = quantize_fp8_triton(x, **kwargs), quantize_fp8_reference(x, **kwargs)
    assert (got.rows is None) == (not rows) and (got.cols_t is None) == (not cols_t)
    if rows:
        assert_same(got.rows, want.rows)
    if cols_t:
        assert_same(got.cols_t, want.cols_t)
    assert (got.col_sum is None) == (not col_sum)


def test_tensor_scales_with_both_outputs_take_the_software_rounding_path():
    # the hardware cast miscompiled this combination on the H200 (rows of the row-major operand)
    from gem_precision.fp8_quant_triton import _cast_software_round

    assert _cast_software_round(None, tensorwise=True, rows=True, cols_t=True) is True
    assert _cast_software_round(False, tensorwise=True, rows=True, cols_t=True) is False  # asked for
    assert _cast_software_round(True, tensorwise=False, rows=True, cols_t=True) is True


def test_given_column_maxima_replace_the_stats_pass(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer's column maxima (gem_model.api.PrequantizedRows) give the transposed operand the bits of
    computing them, with no stats pass; other maxima are used as given, not recomputed."""
    from gem_precision import fp8_quant_triton

    x = wide_range_randn(21, 40, generator=gen).bfloat16()
    x[5, 7] = float("inf")
    bits = (x.float().view(torch.int32) & 0x7FFFFFFF).amax(0)
    kwargs = {"granularity": "row", "fmt": E4M3, "rows": False, "cols_t": True, "pad_to": 16}
    want = quantize_fp8_reference(x, **kwargs).cols_t
    monkeypatch.setattr(fp8_quant_triton, "_fp8_stats_kernel", None)  # launching it would fail
    assert_same(quantize_fp8_triton(x, col_amax_bits=bits, **kwargs).cols_t, want)
    assert_same(quantize_fp8_reference(x, col_amax_bits=bits, **kwargs).cols_t, want)
    doubled = (bits.view(torch.float32) * 2).view(torch.int32)  # one more bit of headroom per finite column
    got = quantize_fp8_triton(x, col_amax_bits=doubled, **kwargs).cols_t
    assert_same(got, quantize_fp8_reference(x, col_amax_bits=doubled, **kwargs).cols_t)
    assert got is not None and want is not None
    finite = want.scale_inv.isfinite().flatten()
    assert torch.equal(got.scale_inv[finite], want.scale_inv[finite] * 2)


@pytest.mark.parametrize(
    ("granularity", "bits", "message"),
    [
        ("tensor", torch.zeros(50, dtype=torch.int32), "granularity 'tensor' has none"),
        ("row", torch.zeros(49, dtype=torch.int32), r"int32 \[50\] on cpu, got torch.int32 \(49,\)"),
        ("row", torch.zeros(50), r"int32 \[50\] on cpu, got torch.float32 \(50,\)"),
    ],
)
def test_given_column_maxima_are_checked(granularity: str, bits: torch.Tensor, message: str) -> None:
    x = torch.randn(8, 50)
    for quantize in (quantize_fp8_reference, quantize_fp8_triton):
        with pytest.raises(ValueError, match=f"{quantize.__name__}: col_amax_bits .*{message}"):
            quantize(x, granularity=granularity, fmt=E4M3, rows=False, cols_t=True, col_amax_bits=bits)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_row_scales_alone_take_one_pass(gen: torch.Generator, fmt: Fp8Format, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows alone (with or without the column sums) run the one-pass kernel, not the stats and cast
    passes, and give the reference's bits: every edge case, random bf16 and fp32 rows, row counts that
    leave a program's last rows empty, and a zero-row input."""
    from gem_precision import fp8_quant_triton

    monkeypatch.setattr(fp8_quant_triton, "_fp8_stats_kernel", None)  # launching either would fail
    monkeypatch.setattr(fp8_quant_triton, "_fp8_cast_kernel", None)
    inputs = [*CASES.values(), wide_range_randn(37, 50, generator=gen), wide_range_randn(70, 24, generator=gen).bfloat16()]
    for x in [*inputs, torch.randn(0, 8)]:
        for col_sum in (False, True):
            kwargs = {"granularity": "row", "fmt": fmt, "rows": True, "cols_t": False, "col_sum": col_sum}
            got, want = quantize_fp8_triton(x, **kwargs), quantize_fp8_reference(x, **kwargs)
            assert_same(got.rows, want.rows)
            assert got.cols_t is None and (got.col_sum is None) == (not col_sum)
            if col_sum and x.isfinite().all():
                scale = max(want.col_sum.abs().max().item(), 1.0)
                torch.testing.assert_close(got.col_sum, want.col_sum, rtol=1e-5, atol=1e-5 * scale)


def test_rows_wider_than_one_pass_take_the_two_passes(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    from gem_precision import fp8_rows_triton

    monkeypatch.setattr(fp8_rows_triton, "ONE_PASS_MAX_N", 32)
    x = wide_range_randn(20, 40, generator=gen)
    with pytest.raises(ValueError, match="column sums need rows of at most 32 elements, got 40"):
        fp8_rows_triton.quantize_rows(x, E4M3, col_sum=True)
    monkeypatch.setattr(fp8_rows_triton, "_fp8_rows_kernel", None)  # launching it would fail
    kwargs = {"granularity": "row", "fmt": E4M3, "rows": True, "cols_t": False, "col_sum": True}
    got, want = quantize_fp8_triton(x, **kwargs), quantize_fp8_reference(x, **kwargs)
    assert_same(got.rows, want.rows)
    torch.testing.assert_close(got.col_sum, want.col_sum, rtol=1e-5, atol=1e-5 * want.col_sum.abs().max().item())
