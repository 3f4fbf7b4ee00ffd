"""The ``bf16`` scheme's linear and its float32 gradients (:mod:`gem_precision.bf16_linear`).

On the CPU, on fresh random data: :class:`Bf16LinearFunction` gives bitwise the output, ``dx`` and
``dW`` of the plain form (``F.linear`` on bf16 casts, autograd's gradients cast back to float32),
and a bias gradient summed in float32 that is at least as close to the float64 sum as the plain
form's bf16 one (and within one bf16 rounding of it); ``Bf16Linear`` on the CPU takes the plain form.
The GPU path (``mm`` with ``out_dtype``, which the CPU lacks) is checked on the GPU by
``benchmarks/weight_grad.py``, which exits unless its float32 ``dW`` and ``db`` are at least as close
to float64 as the plain form's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gem_precision.bf16_linear import Bf16Linear, Bf16LinearFunction, float32_weight_grad

BF16 = torch.bfloat16


def plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight.to(BF16), None if bias is None else bias.to(BF16))


def grads(fn, x: torch.Tensor, linear: nn.Linear, gy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().requires_grad_(x.requires_grad)
    linear.zero_grad(set_to_none=True)
    y = fn(x, linear.weight, linear.bias)
    y.backward(gy)
    out = (y.detach(), x.grad, linear.weight.grad)
    return out + ((linear.bias.grad,) if linear.bias is not None and linear.bias.requires_grad else ())


@pytest.mark.parametrize("shape", [(50,), (3, 17)], ids=["2d", "3d"])
@pytest.mark.parametrize("bias", ["bias", "no_bias", "frozen_bias"])
def test_function_matches_the_plain_form_on_cpu(gen: torch.Generator, shape: tuple[int, ...], bias: str) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    linear = nn.Linear(96, 40, bias=bias != "no_bias")
    if bias == "frozen_bias":
        linear.bias.requires_grad_(False)  # lent elsewhere (gem_model.linear_bias): no gradient asked
    x = torch.randn(*shape, 96, generator=gen).to(BF16).requires_grad_()
    gy = torch.randn(*shape, 40, generator=gen).to(BF16)
    ours = grads(Bf16LinearFunction.apply, x, linear, gy)
    ref = grads(plain, x, linear, gy)
    for name, a, b in zip(("y", "dx", "dW"), ours[:3], ref[:3], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert ours[2].dtype == torch.float32
    if bias == "bias":
        exact = gy.double().reshape(-1, 40).sum(0)
        db, db_plain = ours[3], ref[3]
        assert db.dtype == torch.float32
        assert (db.double() - exact).abs().max() <= (db_plain.double() - exact).abs().max() + 1e-6
        assert torch.equal(db.to(BF16).float(), db_plain) or (db - db_plain).abs().max() <= db_plain.abs().max() * 2**-7


def test_no_input_gradient_asked(gen: torch.Generator) -> None:
    linear = nn.Linear(32, 16)
    x = torch.randn(20, 32, generator=gen).to(BF16)  # a leaf that needs no gradient
    y = Bf16LinearFunction.apply(x, linear.weight, linear.bias)
    y.backward(torch.randn(20, 16, generator=gen).to(BF16))
    assert linear.weight.grad is not None and linear.weight.grad.dtype == torch.float32


def test_float32_weight_grad_on_cpu_is_the_bf16_product_cast(gen: torch.Generator) -> None:
    g = torch.randn(64, 24, generator=gen).to(BF16)
    x = torch.randn(64, 40, generator=gen).to(BF16)
    dw = float32_weight_grad(g, x)
    assert dw.dtype == torch.float32 and torch.equal(dw, torch.mm(g.t(), x).float())


def test_module_takes_the_plain_form_on_cpu(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[bool] = []
    monkeypatch.setattr(Bf16LinearFunction, "apply", lambda *a: called.append(True))
    module = Bf16Linear(nn.Linear(32, 16), fqn="blocks.0.out")
    x = torch.randn(4, 32, generator=gen)
    y = module(x)
    assert not called and y.dtype == x.dtype
    assert torch.equal(y, plain(x.to(BF16), module.weight, module.bias).float())


@pytest.mark.parametrize("shape", [(50,), (3, 17)], ids=["2d", "3d"])
def test_a_supplied_gemm_runs_in_place_of_f_linear(gen: torch.Generator, shape: tuple[int, ...]) -> None:
    """``gemm=`` (``gem_model.api.LinearGemm``): called once on the input's rows with the bf16 weight and
    bias; its result is the output, and the backward is the scheme's own (same ``dx``, ``dW``, ``db`` as
    without it, here with a GEMM that computes what ``F.linear`` does, plus one)."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    module = Bf16Linear(nn.Linear(96, 40), fqn="blocks.0.uvqk")
    seen = []

    def gemm(x2: torch.Tensor, w16: torch.Tensor, b16: torch.Tensor | None) -> torch.Tensor:
        seen.append((tuple(x2.shape), w16.dtype, None if b16 is None else b16.dtype))
        return F.linear(x2, w16, b16) + 1

    x = torch.randn(*shape, 96, generator=gen).to(BF16)
    gy = torch.randn(*shape, 40, generator=gen).to(BF16)
    assert module.takes_gemm(x)
    supplied = grads(lambda t, w, b: module(t, gemm=gemm), x.requires_grad_(), module, gy)
    assert seen == [((x.numel() // 96, 96), BF16, BF16)]
    own = grads(lambda t, w, b: Bf16LinearFunction.apply(t, w, b) + 1, x, module, gy)
    for name, a, b in zip(("y", "dx", "dW", "db"), supplied, own, strict=True):
        assert torch.equal(a, b), name
    assert supplied[0].shape == (*shape, 40)


def test_a_supplied_gemm_is_refused_where_the_linear_does_not_take_one(monkeypatch) -> None:
    module = Bf16Linear(nn.Linear(32, 16), fqn="blocks.3.uvqk")
    x = torch.randn(4, 32).to(BF16)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert not module.takes_gemm(x)
    with pytest.raises(ValueError, match="blocks.3.uvqk: a supplied GEMM runs only where takes_gemm"):
        module(x, gemm=lambda *a: F.linear(*a))
