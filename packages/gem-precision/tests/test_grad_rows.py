"""fp8_rowwise's linear taking its output gradient's rows from the kernel that wrote the gradient
(``ScaledLinear.grad_rows_slot``, ``gem_model.api.GradRowsSlot``), on CPU through the emulated backend.

What is asserted, on fresh random data: the slot is made only where the rows can stand for the
linear's own quantization (row scales, producer quantization, the bf16 weight gradient, e4m3
gradients), with column sums exactly when the bias takes a gradient; offered the reference's rows and
sums, backward gives bitwise the results of quantizing the gradient itself and quantizes nothing; the
offered rows are what ``dx`` is computed from; without an offer the linear quantizes as before.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from gem_model.api import GradRowsSlot
from gem_precision.recipes import Fp8Recipe
from gem_precision.schemes import Fp8RowwiseScheme, Fp8TensorwiseScheme, MXFP8Scheme
from gem_precision.testing import producer_rows

CPU = torch.device("cpu")
IN, OUT, TOKENS = 64, 48, 37


def rowwise(**options: Any) -> Fp8RowwiseScheme:
    return Fp8RowwiseScheme(Fp8RowwiseScheme.Config(backend="emulated", **options))


class Producer(torch.autograd.Function):
    """Identity forward; backward writes ``scale * g`` (as a kernel writes a gradient) and offers the
    reference's e4m3 rows and (``with_sums``) float32 column sums of ``offered_scale * g`` through the slot."""

    @staticmethod
    def forward(
        ctx: Any, y: torch.Tensor, slot: GradRowsSlot, offered_scale: float, with_sums: bool = True
    ) -> torch.Tensor:  # type: ignore[override]
        ctx.slot, ctx.offered_scale, ctx.with_sums = slot, offered_scale, with_sums
        return y.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        written = g.clone()
        stands_for = written if ctx.offered_scale == 1 else written * ctx.offered_scale
        sums = stands_for.float().sum(0) if ctx.slot.column_sum and ctx.with_sums else None
        ctx.slot.offer(written, producer_rows(stands_for, column_amax=False), sums)
        return written, None, None, None


def run(linear: nn.Module, x: torch.Tensor, gy: torch.Tensor, *, offered_scale: float | None,
        with_sums: bool = True) -> list[torch.Tensor]:  # fmt: skip
    """Output and gradients of ``x``, weight and bias; the gradient reaches the linear through a producer
    that offers rows (``offered_scale`` None: no slot, no producer)."""
    xi = x.detach().clone().requires_grad_()
    if offered_scale is None:
        y = linear(xi)
    else:
        slot = linear.grad_rows_slot(CPU)
        assert slot is not None
        y = Producer.apply(linear(xi, grad_rows=slot), slot, offered_scale, with_sums)
    y.backward(gy)
    return [y.detach(), xi.grad, linear.weight.grad, linear.bias.grad]


def problem(gen: torch.Generator) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return (
        nn.Linear(IN, OUT),
        torch.randn(TOKENS, IN, generator=gen).bfloat16(),
        torch.randn(TOKENS, OUT, generator=gen).bfloat16(),
    )


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def test_the_slot_is_made_only_where_the_rows_stand_for_the_linears_own():
    def slot(scheme: Any, *, frozen_bias: bool = False) -> GradRowsSlot | None:
        module = scheme.convert_linear(nn.Linear(IN, OUT), "blocks.0.uvqk")
        module.bias.requires_grad_(not frozen_bias)
        return module.grad_rows_slot(CPU)

    made = slot(rowwise())
    assert isinstance(made, GradRowsSlot) and made.column_sum  # the defaults; the bias takes a gradient
    assert slot(rowwise(), frozen_bias=True).column_sum is False
    assert slot(rowwise(weight_gradient="fp8")) is None  # the weight gradient needs g along the tokens
    assert slot(rowwise(grad_format="e5m2")) is None  # not the e4m3 rule
    assert slot(rowwise(producer_quantization=False)) is None
    assert slot(Fp8TensorwiseScheme(Fp8TensorwiseScheme.Config(backend="emulated"))) is None
    assert slot(MXFP8Scheme(MXFP8Scheme.Config(backend="emulated"))) is None


@pytest.mark.parametrize("with_sums", [True, False])
def test_offered_rows_give_bitwise_the_linears_own_results_and_nothing_is_quantized(gen, monkeypatch, with_sums):
    """With the column sums offered too, every result is bitwise the linear's own; rows offered alone (as
    the layer norm's backward does) leave the bias gradient to the linear, which sums the gradient itself
    (to fp32 rounding), still without quantizing anything."""
    linear, x, gy = problem(gen)
    module = rowwise().convert_linear(linear, "blocks.0.uvqk")
    own = run(copy.deepcopy(module), x, gy, offered_scale=None)
    roles: list[str] = []
    real = Fp8Recipe.quantize
    monkeypatch.setattr(Fp8Recipe, "quantize", lambda self, t, **kw: roles.append(kw["role"]) or real(self, t, **kw))
    taken = run(copy.deepcopy(module), x, gy, offered_scale=1, with_sums=with_sums)
    assert "grad" not in roles  # backward quantized nothing
    for name, got, want in zip(["y", "dx", "dW", "db"][: 4 if with_sums else 3], taken, own):
        assert torch.equal(got, want), f"{name} differs"
    if not with_sums:
        torch.testing.assert_close(taken[3], gy.double().sum(0).float(), rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(taken[3], own[3], rtol=1e-6, atol=1e-5)


def test_dx_is_computed_from_the_offered_rows(gen):
    """Rows offered for ``2 g`` while the gradient is ``g``: ``dx`` and the bias gradient follow the offer,
    the bf16 weight gradient (from the unquantized ``g``) does not."""
    linear, x, gy = problem(gen)
    module = rowwise().convert_linear(linear, "blocks.0.uvqk")
    own = run(copy.deepcopy(module), x, gy, offered_scale=None)
    doubled = run(copy.deepcopy(module), x, gy, offered_scale=2)
    assert torch.equal(doubled[1], own[1] * 2)  # powers of two scale exactly through the rows and the GEMM
    assert torch.equal(doubled[3], own[3] * 2)
    assert torch.equal(doubled[2], own[2])


def test_a_linear_whose_output_has_a_second_use_quantizes_its_gradient_itself(gen, monkeypatch):
    linear, x, gy = problem(gen)
    module = rowwise().convert_linear(linear, "blocks.0.uvqk")
    slot = module.grad_rows_slot(CPU)
    roles: list[str] = []
    real = Fp8Recipe.quantize
    monkeypatch.setattr(Fp8Recipe, "quantize", lambda self, t, **kw: roles.append(kw["role"]) or real(self, t, **kw))
    xi = x.detach().clone().requires_grad_()
    y = module(xi, grad_rows=slot)
    (Producer.apply(y, slot, 2.0) * gy + y * gy).sum().backward()  # the offer is for one of two gradients
    assert "grad" in roles
    want = copy.deepcopy(module)
    xw = x.detach().clone().requires_grad_()
    want(xw).backward(gy * 2)
    assert torch.equal(xi.grad, xw.grad)  # dx from the summed gradient, not from the offer's rows


def test_grad_rows_must_be_a_slot(gen):
    linear, x, _ = problem(gen)
    module = rowwise().convert_linear(linear, "blocks.0.uvqk")
    with pytest.raises(TypeError, match="blocks.0.uvqk: grad_rows must be a GradRowsSlot, got dict"):
        module(x, grad_rows={})
