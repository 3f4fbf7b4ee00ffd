"""Precision schemes on CPU: converted linears keep their parameters; forward and gradients match
fp32 within the stated tolerances and an explicit quantize-dequantize computation almost exactly.

Tolerances (relative Frobenius error vs the fp32 linear, K = 256, N = 128, M = 512): bf16 1e-2;
fp8 forward 8e-2 and gradients 1e-1 (e4m3 rounding of both operands, ~2.7% each; e5m2 gradients
under tensorwise are coarser); mxfp8 1e-1 (the spec's floor scale saturates values in the top
eighth of a block's range, which hurts on uniform data such as nn.Linear's default init).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from gem_precision.bf16_linear import Bf16Linear
from gem_precision.formats import E4M3, fp8_format
from gem_precision.fp8_reference import quantize_fp8_reference
from gem_precision.mx_reference import mx_dequantize, mx_quantize
from gem_precision.scaled_linear import ScaledLinear
from gem_precision.schemes import (
    Bf16Scheme,
    Fp8RowwiseScheme,
    Fp8TensorwiseScheme,
    Fp32Scheme,
    MXFP8Scheme,
    ScaledScheme,
)
from gem_precision.testing import rel_err

SCALED = [Fp8TensorwiseScheme, Fp8RowwiseScheme, MXFP8Scheme]
TOLERANCE = {"bf16": (1e-2, 1e-2), "fp8_tensorwise": (8e-2, 1e-1), "fp8_rowwise": (8e-2, 1e-1), "mxfp8": (1e-1, 1e-1)}


def run(module: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_(True)
    y = module(x)
    y.backward(gy)
    bias_grad = module.bias.grad if module.bias is not None else None
    return y.detach(), x.grad, module.weight.grad, bias_grad


@pytest.fixture
def problem(gen: torch.Generator) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    linear = nn.Linear(256, 128)
    return linear, torch.randn(4, 128, 256, generator=gen), torch.randn(4, 128, 128, generator=gen)


@pytest.mark.parametrize("cls", [Fp32Scheme, Bf16Scheme, *SCALED], ids=lambda c: c.name)
def test_converted_linear_keeps_parameters(cls: type) -> None:
    linear = nn.Linear(64, 32)
    converted = cls().convert_linear(linear, "blocks.0.proj")
    assert [n for n, _ in converted.named_parameters()] == ["weight", "bias"]
    assert converted.weight is linear.weight and converted.bias is linear.bias
    assert converted.weight.dtype == torch.float32
    no_bias = cls().convert_linear(nn.Linear(64, 32, bias=False), "head")
    assert [n for n, _ in no_bias.named_parameters()] == ["weight"]


def test_fp32_returns_the_linear_itself() -> None:
    linear = nn.Linear(8, 8)
    assert Fp32Scheme().convert_linear(linear, "x") is linear


@pytest.mark.parametrize("cls", [Bf16Scheme, *SCALED], ids=lambda c: c.name)
def test_forward_and_gradients_close_to_fp32(cls: type, problem) -> None:
    linear, x, gy = problem
    want = run(copy.deepcopy(linear), x, gy)
    module = cls().convert_linear(copy.deepcopy(linear), "proj")
    got = run(module, x, gy)
    fwd_tol, grad_tol = TOLERANCE[cls.name]
    assert got[0].dtype == x.dtype and got[2].dtype == torch.float32
    assert rel_err(got[0], want[0]) < fwd_tol
    for g, w in zip(got[1:], want[1:]):
        assert rel_err(g, w) < grad_tol


def test_schemes_declare_their_activation_dtype(problem) -> None:
    linear, x, _ = problem
    assert Fp32Scheme.activation_dtype == "float32"
    for cls in (Bf16Scheme, Fp8TensorwiseScheme, Fp8RowwiseScheme, MXFP8Scheme):
        assert cls.activation_dtype == "bfloat16", cls.name
    module = Bf16Scheme().convert_linear(linear, "proj")
    assert isinstance(module, Bf16Linear)
    assert module(x.bfloat16()).dtype == torch.bfloat16 and module(x).dtype == x.dtype


@pytest.mark.parametrize("cls", [Fp8TensorwiseScheme, Fp8RowwiseScheme], ids=lambda c: c.name)
def test_fp8_matches_explicit_quantize_dequantize(cls: type, problem) -> None:
    linear, x, gy = problem
    scheme = cls()
    got = run(scheme.convert_linear(copy.deepcopy(linear), "proj"), x, gy)
    gran, gfmt = cls.granularity, fp8_format(scheme.config.grad_format)

    def qdq(t: torch.Tensor, fmt=E4M3, transposed: bool = False) -> torch.Tensor:
        pair = quantize_fp8_reference(t, granularity=gran, fmt=fmt, rows=not transposed, cols_t=transposed)
        op = pair.cols_t if transposed else pair.rows
        return op.dequantize()

    x2, g2, w = x.reshape(-1, 256), gy.reshape(-1, 128), linear.weight.detach()
    y = qdq(x2) @ qdq(w).t() + linear.bias.detach()
    dx = qdq(g2, gfmt) @ qdq(w, transposed=True).t()  # g @ W with W.T quantized along out_features
    if getattr(scheme.config, "weight_gradient", "fp8") == "bf16":  # fp8_rowwise's default: dW unquantized
        dw = g2.t().to(x2.dtype) @ x2
    else:
        dw = qdq(g2, gfmt, transposed=True) @ qdq(x2, transposed=True).t()
    assert rel_err(got[0].reshape(-1, 128), y) < 1e-6
    assert rel_err(got[1].reshape(-1, 256), dx) < 1e-6
    assert rel_err(got[2], dw) < 1e-6
    assert rel_err(got[3], g2.sum(0)) < 1e-6


def test_mxfp8_matches_explicit_quantize_dequantize(problem) -> None:
    linear, x, gy = problem
    got = run(MXFP8Scheme().convert_linear(copy.deepcopy(linear), "proj"), x, gy)
    x2, g2, w = x.reshape(-1, 256), gy.reshape(-1, 128), linear.weight.detach()

    def qdq(t: torch.Tensor, axis: int = -1) -> torch.Tensor:
        return mx_dequantize(mx_quantize(t, axis=axis))

    assert rel_err(got[0].reshape(-1, 128), qdq(x2) @ qdq(w).t() + linear.bias.detach()) < 1e-6
    assert rel_err(got[1].reshape(-1, 256), qdq(g2) @ qdq(w, axis=0).t()) < 1e-6
    assert rel_err(got[2], qdq(g2, axis=0) @ qdq(x2, axis=0).t()) < 1e-6


def test_mxfp8_triton_backend_equals_emulated(gen: torch.Generator) -> None:
    linear = nn.Linear(96, 64)
    x, gy = torch.randn(70, 96, generator=gen), torch.randn(70, 64, generator=gen)
    emulated = run(
        MXFP8Scheme(MXFP8Scheme.Config(backend="emulated")).convert_linear(copy.deepcopy(linear), "p"), x, gy
    )
    scheme = MXFP8Scheme(MXFP8Scheme.Config(backend="triton"))
    assert scheme.resolved_backend("cpu") == "triton"  # allowed on CPU only under TRITON_INTERPRET=1
    triton_out = run(scheme.convert_linear(copy.deepcopy(linear), "p"), x, gy)
    for a, b in zip(triton_out, emulated):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("cls", SCALED, ids=lambda c: c.name)
def test_backends_resolve_on_cpu(cls: type) -> None:
    assert cls().resolved_backend("cpu") == "emulated"
    assert cls(cls.Config(backend="emulated")).resolved_backend("cpu") == "emulated"
    native = cls(cls.Config(backend="native"))
    with pytest.raises(RuntimeError, match=rf"{cls.name}.*'native' needs .*cpu"):
        native.check_device("cpu")


def test_native_fp8_rejects_unaligned_linear_at_conversion() -> None:
    with pytest.raises(ValueError, match=r"heads\.click.*divisible by 16"):
        Fp8RowwiseScheme(Fp8RowwiseScheme.Config(backend="native")).convert_linear(nn.Linear(64, 1), "heads.click")


@pytest.mark.parametrize("cls", SCALED, ids=lambda c: c.name)
def test_nonfinite_input_gives_nan_rows_not_saturated_values(cls: type, gen: torch.Generator) -> None:
    x = torch.randn(8, 64, generator=gen)
    x[2, 5] = float("inf")
    y = cls().convert_linear(nn.Linear(64, 32), "p")(x)
    assert y[2].isnan().all()
    if cls is not Fp8TensorwiseScheme:  # one scale per tensor: the whole output is NaN
        assert not y[torch.arange(8) != 2].isnan().any()


@pytest.mark.parametrize("cls", SCALED, ids=lambda c: c.name)
def test_inference_and_partial_gradients(cls: type, gen: torch.Generator) -> None:
    module = cls().convert_linear(nn.Linear(64, 32), "p")
    x = torch.randn(5, 64, generator=gen)
    with torch.no_grad():
        y = module(x)
    assert y.shape == (5, 32) and not y.requires_grad
    module.weight.requires_grad_(False)
    xr = x.clone().requires_grad_(True)
    module(xr).sum().backward()
    assert xr.grad is not None and module.weight.grad is None and module.bias.grad is not None
    assert module(torch.zeros(0, 64)).shape == (0, 32)
    assert isinstance(module, ScaledLinear)
    with pytest.raises(ValueError, match="p: expected input with last dim 64"):
        module(torch.zeros(3, 63))


def test_config_rejects_unknown_options() -> None:
    with pytest.raises(ValueError):
        Fp8RowwiseScheme.Config(backend="fast")
    with pytest.raises(ValueError):
        MXFP8Scheme.Config(block=16)
    assert Fp8TensorwiseScheme().config.grad_format == "e5m2"
    assert Fp8RowwiseScheme().config.grad_format == "e4m3"
    assert issubclass(MXFP8Scheme, ScaledScheme)
