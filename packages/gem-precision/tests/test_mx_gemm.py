"""The Triton MX GEMM (under TRITON_INTERPRET=1) equals the reference up to float32 summation order."""

from __future__ import annotations

import pytest
import torch

from gem_precision.mx_gemm import mx_gemm_triton, native_mx_shape_problem, to_blocked
from gem_precision.mx_reference import mx_gemm_reference, mx_quantize
from gem_precision.testing import rel_err, wide_range_randn

TINY = {"BLOCK_M": 32, "BLOCK_N": 32, "SUB_K": 2, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


@pytest.mark.parametrize(("m", "n", "k"), [(64, 64, 128), (40, 33, 100), (32, 48, 32), (70, 20, 17)])
def test_matches_reference(gen: torch.Generator, m: int, n: int, k: int) -> None:
    a = mx_quantize(torch.randn(m, k, generator=gen))
    b = mx_quantize(torch.randn(n, k, generator=gen))
    got = mx_gemm_triton(a, b, out_dtype=torch.float32)
    assert rel_err(got, mx_gemm_reference(a, b)) < 1e-5


def test_wide_range_scales_and_sub_k(gen: torch.Generator) -> None:
    # block scales that differ by many binades inside one tile: the fold must apply each slice's own
    a = mx_quantize(wide_range_randn(32, 256, generator=gen, spread=20))
    b = mx_quantize(wide_range_randn(32, 256, generator=gen, spread=20))
    want = mx_gemm_reference(a, b)
    for sub_k in (1, 2):
        got = mx_gemm_triton(a, b, out_dtype=torch.float32, config={**TINY, "SUB_K": sub_k})
        assert rel_err(got, want) < 1e-5


def test_bias_and_bf16_output(gen: torch.Generator) -> None:
    a = mx_quantize(torch.randn(48, 96, generator=gen))
    b = mx_quantize(torch.randn(40, 96, generator=gen))
    bias = torch.randn(40, generator=gen)
    got = mx_gemm_triton(a, b, out_dtype=torch.bfloat16, bias=bias)
    assert got.dtype == torch.bfloat16
    want = mx_gemm_reference(a, b) + bias
    assert rel_err(got.float(), want) < 2**-8  # one bfloat16 rounding of the result


@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_nan_block_poisons_only_its_row_and_column(gen: torch.Generator) -> None:
    x, w = torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)
    x[3, 40] = float("inf")
    got = mx_gemm_triton(mx_quantize(x), mx_quantize(w), out_dtype=torch.float32)
    assert got[3].isnan().all()
    assert not got[torch.arange(32) != 3].isnan().any()


def test_shape_errors() -> None:
    a, b = mx_quantize(torch.randn(4, 64)), mx_quantize(torch.randn(4, 32))
    with pytest.raises(ValueError, match="reduction dims differ"):
        mx_gemm_triton(a, b)
    assert native_mx_shape_problem(128, 128, 100) is not None
    assert native_mx_shape_problem(128, 128, 128) is None


def test_to_blocked_follows_the_cublas_layout(gen: torch.Generator) -> None:
    # cuBLAS block-scaling layout: 128x4 tiles (row-major over tiles); inside a tile, row r and column c
    # sit at (r % 32) * 16 + (r // 32) * 4 + c; padding is zero
    rows, cols = 200, 9
    scale = torch.randint(1, 255, (rows, cols), generator=gen, dtype=torch.uint8)
    flat = to_blocked(scale.view(torch.float8_e8m0fnu)).view(torch.uint8)
    n_col_tiles = -(-cols // 4)
    assert flat.numel() == (-(-rows // 128) * 128) * (n_col_tiles * 4)
    expected = torch.zeros_like(flat)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * n_col_tiles + c // 4
            expected[tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] = scale[r, c]
    assert torch.equal(flat, expected)


@pytest.mark.parametrize("sub_k", [1, 2, 4])
def test_bf16_dequant_variant_matches_reference(gen: torch.Generator, sub_k: int) -> None:
    # DEQUANT: scaled bf16 operands (exact) into one float32 accumulation, no per-slice fold
    a = mx_quantize(wide_range_randn(40, 200, generator=gen, spread=20))
    b = mx_quantize(wide_range_randn(33, 200, generator=gen, spread=20))
    got = mx_gemm_triton(a, b, out_dtype=torch.float32, config={**TINY, "SUB_K": sub_k, "DEQUANT": 1})
    assert rel_err(got, mx_gemm_reference(a, b)) < 1e-6


def test_autotune_list_has_both_variants() -> None:
    from gem_precision.mx_gemm import _configs

    kinds = {c.kwargs["DEQUANT"] for c in _configs()}
    assert kinds == {0, 1}
    # the default tuner holds only the float32-accumulating variant (the 1e-5 contract on Hopper)
    from gem_precision.mx_gemm import _mx_gemm_tuned, _mx_gemm_tuned_fp8_acc

    assert {c.kwargs["DEQUANT"] for c in _mx_gemm_tuned.configs} == {1}
    assert {c.kwargs["DEQUANT"] for c in _mx_gemm_tuned_fp8_acc.configs} == {0, 1}
    with pytest.raises(ValueError, match="SUB_K"):
        a = mx_quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)))
        mx_gemm_triton(a, a, config={**TINY, "SUB_K": 4})
