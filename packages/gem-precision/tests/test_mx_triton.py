"""Triton MX quantize/dequantize kernels (under TRITON_INTERPRET=1) are bit-identical to the reference."""

from __future__ import annotations

import pytest
import torch

from gem_precision.mx_reference import MXTensor, mx_dequantize, mx_quantize
from gem_precision.mx_triton import mx_dequantize_triton, mx_quantize_triton
from gem_precision.testing import mx_edge_cases, raw_bytes, wide_range_randn

EDGE = mx_edge_cases()


def assert_same(got: MXTensor | None, want: MXTensor) -> None:
    assert got is not None
    assert got.shape == want.shape
    assert torch.equal(raw_bytes(got.data), raw_bytes(want.data))
    assert torch.equal(raw_bytes(got.scale), raw_bytes(want.scale))


def check(x: torch.Tensor, rows: bool = True, cols_t: bool = True) -> None:
    row_op, col_op = mx_quantize_triton(x, rows=rows, cols_t=cols_t)
    if rows:
        assert_same(row_op, mx_quantize(x))
    else:
        assert row_op is None
    if cols_t:
        assert_same(col_op, mx_quantize(x, axis=0))
    else:
        assert col_op is None


@pytest.mark.parametrize("name", sorted(EDGE))
def test_edge_cases_bit_identical(name: str) -> None:
    check(EDGE[name])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 64), (45, 70), (33, 31), (1, 200)])
def test_random_bit_identical(gen: torch.Generator, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    check(wide_range_randn(*shape, generator=gen).to(dtype))


@pytest.mark.parametrize(("rows", "cols_t"), [(True, False), (False, True)])
def test_single_output_modes(gen: torch.Generator, rows: bool, cols_t: bool) -> None:
    check(torch.randn(40, 72, generator=gen), rows=rows, cols_t=cols_t)


def test_strided_rows_input(gen: torch.Generator) -> None:
    base = torch.randn(32, 100, generator=gen)
    view = base[:, :64]  # rows contiguous, row stride 100
    check(view)


def test_dequantize_kernel_matches_reference(gen: torch.Generator) -> None:
    x = wide_range_randn(33, 70, generator=gen)
    x[3, 5] = float("nan")
    mx = mx_quantize(x)
    for dtype in (torch.float32, torch.bfloat16):
        torch.testing.assert_close(
            mx_dequantize_triton(mx, dtype), mx_dequantize(mx, dtype), rtol=0, atol=0, equal_nan=True
        )


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="2-d"):
        mx_quantize_triton(torch.zeros(2, 3, 32))
    with pytest.raises(ValueError, match="rows, cols_t or both"):
        mx_quantize_triton(torch.zeros(2, 32), rows=False, cols_t=False)
    with pytest.raises(ValueError, match="multiples of 32"):
        mx_quantize_triton(torch.zeros(2, 32), tile=(32, 48, 4))
