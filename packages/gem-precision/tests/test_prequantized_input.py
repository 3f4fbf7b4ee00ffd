"""ScaledLinear as the consumer of gem_model.api's pre-quantized input rows: fp8_rowwise asks for them and,
given the rows a producer wrote (here the reference quantizer stands in for it), uses them in place of
quantizing its input, with the same bits, output and gradients; fp8_tensorwise and mxfp8 decline; rows
that do not fit are refused naming the linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gem_model.api import PrequantizedRows, RowQuantization
from gem_precision.recipes import Fp8Recipe
from gem_precision.schemes import Fp8RowwiseScheme, Fp8TensorwiseScheme, MXFP8Scheme
from gem_precision.testing import producer_rows, wide_range_randn

CPU = torch.device("cpu")


def rowwise(linear: nn.Linear, fqn: str = "blocks.0.uvqk") -> nn.Module:
    """fp8 rowwise with its fp8 weight gradient, whose transposed operand of x needs the column maxima
    (test_weight_gradient covers the default bf16 weight gradient, which asks for the rows alone)."""
    config = Fp8RowwiseScheme.Config(backend="emulated", producer_quantization=True, weight_gradient="fp8")
    return Fp8RowwiseScheme(config).convert_linear(linear, fqn)


def test_fp8_rowwise_asks_for_rows_and_column_maxima_only_when_a_weight_gradient_follows():
    linear = rowwise(nn.Linear(32, 16))
    assert linear.input_quantization(CPU) == RowQuantization(column_amax=True)
    with torch.no_grad():
        assert linear.input_quantization(CPU) == RowQuantization(column_amax=False)
    linear.weight.requires_grad_(False)
    assert linear.input_quantization(CPU) == RowQuantization(column_amax=False)


def test_fp8_rowwise_takes_producer_rows_only_when_its_option_asks():
    """On by default (with the default bf16 weight gradient: rows alone); producer_quantization=false declines."""
    default = Fp8RowwiseScheme(Fp8RowwiseScheme.Config(backend="emulated")).convert_linear(nn.Linear(32, 16), "out")
    assert default.input_quantization(CPU) == RowQuantization(column_amax=False)
    config = Fp8RowwiseScheme.Config(backend="emulated", producer_quantization=False)
    linear = Fp8RowwiseScheme(config).convert_linear(nn.Linear(32, 16), "out")
    assert linear.input_quantization(CPU) is None
    x = torch.randn(4, 32).bfloat16()
    with pytest.raises(ValueError, match=r"out: precision scheme 'fp8_rowwise' .* takes no pre-quantized"):
        linear(x, prequantized=producer_rows(x, column_amax=False))


@pytest.mark.parametrize("scheme", [Fp8TensorwiseScheme, MXFP8Scheme], ids=lambda c: c.name)
def test_other_scaled_schemes_decline_and_refuse_rows(scheme):
    linear = scheme(scheme.Config(backend="emulated")).convert_linear(nn.Linear(32, 16), "blocks.1.out")
    assert linear.input_quantization(CPU) is None
    x = torch.randn(4, 32).bfloat16()
    with pytest.raises(ValueError, match=rf"blocks.1.out: precision scheme '{scheme.name}' .* takes no pre-quantized"):
        linear(x, prequantized=producer_rows(x, column_amax=False))


@pytest.mark.parametrize("column_amax", [True, False])
def test_given_rows_give_the_same_bits_output_and_gradients(gen, monkeypatch, column_amax):
    linear = rowwise(nn.Linear(40, 24))
    x = wide_range_randn(21, 40, generator=gen).view(3, 7, 40).bfloat16()
    x[1, 2] = 0  # a row of zeros
    dy = torch.randn(3, 7, 24, generator=gen).bfloat16()
    results = []
    for rows in (None, producer_rows(x, column_amax=column_amax)):
        xi = x.clone().requires_grad_()
        y = linear(xi, prequantized=rows)
        results.append((y, *torch.autograd.grad(y, [xi, linear.weight, linear.bias], dy)))
    for got, want in zip(results[1], results[0]):
        assert torch.equal(got, want)
    # the given rows are what the forward GEMM reads: other rows, another output
    quantize_calls = []
    real = Fp8Recipe.quantize
    monkeypatch.setattr(Fp8Recipe, "quantize", lambda self, t, **kw: quantize_calls.append(kw["role"]) or real(self, t, **kw))
    halved = producer_rows(x, column_amax=column_amax)
    halved = PrequantizedRows(halved.data, halved.scale_inv / 2, halved.column_amax_bits)
    y = linear(x.clone().requires_grad_(), prequantized=halved)
    assert "input" not in quantize_calls  # the input's row operand came from the rows given
    torch.testing.assert_close(y.float(), (results[0][0].float() - linear.bias) / 2 + linear.bias, rtol=2e-2, atol=1e-2)


def test_rows_that_do_not_match_the_input_are_refused():
    linear = rowwise(nn.Linear(32, 16), "blocks.3.out")
    x = torch.randn(6, 32).bfloat16()
    with pytest.raises(ValueError, match=r"blocks.3.out: pre-quantized rows \(5, 32\) .* do not match the input \(6, 32\)"):
        linear(x, prequantized=producer_rows(x[:5], column_amax=True))
