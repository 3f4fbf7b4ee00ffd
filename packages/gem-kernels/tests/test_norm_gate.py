"""Both norm_gate kernels (output and grads for x, u, weight, bias) against the float64 reference."""

from __future__ import annotations

import pytest
import torch

from gem_kernels.norm_gate import TorchNormGate, TritonNormGate
from gem_kernels.reference import norm_gate_reference
from gem_kernels.testing import relative_error
from gem_model.components import NormGateKernel

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}

pytestmark = pytest.mark.usefixtures("poison")


def errors(kernel: NormGateKernel, x: torch.Tensor, u: torch.Tensor, gen: torch.Generator) -> dict[str, float]:
    dim = x.shape[-1]
    weight = torch.randn(dim, generator=gen)
    bias = torch.randn(dim, generator=gen)
    grad_out = torch.randn(x.shape, generator=gen).to(x.dtype)
    leaves = [t.detach().requires_grad_() for t in (x, u, weight, bias)]
    out = kernel(*leaves, 1e-5)
    grads = torch.autograd.grad(out, leaves, grad_out)
    exact = [t.detach().double().requires_grad_() for t in (x, u, weight, bias)]
    expected = norm_gate_reference(*exact, 1e-5)
    expected_grads = torch.autograd.grad(expected, exact, grad_out.double())
    names = ("out", "dx", "du", "dweight", "dbias")
    return {n: relative_error(a, b) for n, a, b in zip(names, (out, *grads), (expected, *expected_grads), strict=True)}


@pytest.mark.parametrize("kernel", [TorchNormGate(), TritonNormGate()], ids=["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 25, 64, 200])
def test_matches_reference(gen: torch.Generator, kernel: NormGateKernel, dtype: torch.dtype, dim: int) -> None:
    rows = int(torch.randint(1, 80, (1,), generator=gen))
    x = torch.randn(rows, dim, generator=gen).to(dtype)
    u = torch.randn(rows, dim, generator=gen).to(dtype)
    found = errors(kernel, x, u, gen)
    assert max(found.values()) < TOLERANCE[dtype], found


def test_triton_takes_strided_rows_and_leading_dims(gen: torch.Generator) -> None:
    x = torch.randn(3, 7, 25, generator=gen)
    u = torch.randn(3, 7, 40, generator=gen)[..., 5:30]  # rows 40 apart, as a split of a wider projection
    found = errors(TritonNormGate(), x, u, gen)
    assert max(found.values()) < 1e-5, found


def test_triton_takes_no_rows(gen: torch.Generator) -> None:
    found = errors(TritonNormGate(), torch.zeros(0, 16), torch.zeros(0, 16), gen)
    assert max(found.values()) == 0.0, found


def test_rejects_mismatched_shapes() -> None:
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="weight and bias"):
        TorchNormGate()(x, x, torch.ones(7), torch.zeros(8), 1e-5)


@pytest.mark.parametrize("rows", [0, 37])
def test_triton_backward_sums_the_gate_gradient_as_it_stores_it(gen: torch.Generator, rows: int) -> None:
    from gem_kernels.norm_gate_triton import NormGateFunction, norm_gate_backward

    dim = 24
    x, u, dy = (torch.randn(rows, dim, generator=gen).bfloat16() for _ in range(3))
    weight, bias = torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)
    _, mean, rstd = NormGateFunction.run_forward(x, u, weight, bias, 1e-5, silu_gate=True)
    plain = norm_gate_backward(dy, x, u, weight, bias, mean, rstd, silu_gate=True)
    sums = torch.full((dim,), float("nan"))
    summed = norm_gate_backward(dy, x, u, weight, bias, mean, rstd, silu_gate=True, du_sum_out=sums)
    for a, b in zip(plain, summed, strict=True):
        assert torch.equal(a, b)  # the sums change nothing else
    # the bf16 du as stored, summed in float32 (the bias gradient the last pass would have summed)
    torch.testing.assert_close(sums, summed[1].double().sum(0).float(), rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match=r"du_sum_out must be float32 \[24\]"):
        norm_gate_backward(dy, x, u, weight, bias, mean, rstd, du_sum_out=torch.zeros(dim, dtype=torch.bfloat16))
