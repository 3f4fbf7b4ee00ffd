"""fp8 operands with 1 x 128 block scales for the weight gradient: the reference against its definition
(per column and block of rows: the scalar power-of-two rule, zero padding, the scales' layout), the
Triton kernel (under TRITON_INTERPRET=1) bit-identical to it, and the GEMM those operands stand for."""

from __future__ import annotations

import pytest
import torch

from gem_precision.formats import E4M3, E5M2, Fp8Format
from gem_precision.fp8_blocks_triton import quantize_fp8_blocks_t_triton
from gem_precision.fp8_reference import quantize_blocks_t_reference, quantize_fp8_reference
from gem_precision.testing import raw_bytes, rel_err, wide_range_randn


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_each_column_block_is_a_row_quantized_group(fmt: Fp8Format, gen: torch.Generator) -> None:
    """Block (n, b) holds rows b*16 .. b*16+15 of column n, scaled as the row reference scales one row."""
    x = wide_range_randn(40, 6, generator=gen, spread=12)  # 40 rows: blocks of 16, 16 and 8 (+8 padding)
    op = quantize_blocks_t_reference(x, fmt, block=16)
    assert op.data.shape == (6, 48) and op.scale_inv.shape == (6, 3) and op.scale_inv.stride() == (1, 6)
    assert not raw_bytes(op.data)[:, 40:].any()  # the padding rows are zero bytes
    for b in range(3):
        rows = x[b * 16:(b + 1) * 16].t()  # each column's rows of this block, as a row each
        want = quantize_fp8_reference(rows, granularity="row", fmt=fmt).rows
        assert want is not None
        width = rows.shape[1]
        assert torch.equal(raw_bytes(op.data)[:, b * 16:b * 16 + width], raw_bytes(want.data))
        assert torch.equal(op.scale_inv[:, b], want.scale_inv[:, 0])


def test_a_non_finite_value_poisons_only_its_block(gen: torch.Generator) -> None:
    x = torch.randn(64, 3, generator=gen)
    x[20, 1] = float("inf")
    op = quantize_blocks_t_reference(x, E4M3, block=16)
    assert torch.isnan(op.scale_inv[1, 1]) and (raw_bytes(op.data)[1, 16:32] == 0x7F).all()
    finite = torch.ones_like(op.scale_inv, dtype=torch.bool)
    finite[1, 1] = False
    assert torch.isfinite(op.scale_inv[finite]).all()


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize(("rows", "cols", "block"), [(200, 40, 128), (37, 16, 16), (256, 19, 64)])
def test_triton_is_bit_identical_to_the_reference(gen: torch.Generator, fmt: Fp8Format, rows: int, cols: int,
                                                  block: int) -> None:  # fmt: skip
    x = wide_range_randn(rows, cols, generator=gen, spread=20).to(torch.bfloat16)
    x[3, 5] = float("nan")
    want = quantize_blocks_t_reference(x, fmt, block=block)
    got = quantize_fp8_blocks_t_triton(x, fmt, block=block)
    assert got.scale_inv.shape == want.scale_inv.shape and got.scale_inv.stride() == want.scale_inv.stride()
    assert torch.equal(raw_bytes(got.data), raw_bytes(want.data))
    assert torch.equal(got.scale_inv.view(torch.int32), want.scale_inv.view(torch.int32))  # NaN payloads too


def test_the_block_operands_give_the_weight_gradient(gen: torch.Generator) -> None:
    """Dequantized as the GEMM reads them (each byte times its column's factor for its block of 128
    tokens), the operands are ``g`` and ``x`` within e4m3's rounding (at most 2**-4 of each value, or half
    the smallest subnormal step of its block's scale), and ``g^T x`` from them is within a few per cent of
    the float64 product (random signs: each product's rounding, about 3.5 % RMS, does not cancel)."""
    g, x = torch.randn(300, 24, generator=gen), torch.randn(300, 40, generator=gen)
    gq, xq = quantize_fp8_blocks_t_triton(g), quantize_fp8_blocks_t_triton(x)

    def dequantized(op, tokens: int) -> torch.Tensor:
        factors = op.scale_inv.double().repeat_interleave(128, dim=1)
        return (op.data.double() * factors)[:, :tokens], factors[:, :tokens]

    for op, want in ((gq, g), (xq, x)):
        got, factors = dequantized(op, 300)
        assert ((got - want.double().t()).abs() <= torch.maximum(want.double().t().abs() * 2**-4, factors * 2**-10)).all()
    product = dequantized(gq, 300)[0] @ dequantized(xq, 300)[0].t()
    assert rel_err(product, g.double().t() @ x.double()) < 0.06


def test_bad_input_is_refused(gen: torch.Generator) -> None:
    with pytest.raises(ValueError, match="2-d"):
        quantize_blocks_t_reference(torch.zeros(4), E4M3)
    with pytest.raises(ValueError, match="contiguous rows"):
        quantize_fp8_blocks_t_triton(torch.zeros(8, 4).t(), E4M3)
    with pytest.raises(ValueError, match="power of two"):
        quantize_fp8_blocks_t_triton(torch.zeros(8, 4), E4M3, block=96)
