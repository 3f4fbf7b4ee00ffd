"""fp8_rowwise's high-precision weight gradient (option ``weight_gradient: bf16``, torchao's
``rowwise_with_gw_hp``), on CPU through the emulated backend (the same recipe code as native, with the
torch reference quantization; the native GEMMs need CUDA).

What is asserted, on fresh random data: ``dW`` equals the bf16 reference ``g.bf16().T @ x.bf16()``
(the same torch.mm on the same bf16 operands: bitwise); ``y``, ``dx`` and the bias gradient are bitwise
those of ``weight_gradient: fp8``; the forward saves ``x`` (bf16, as given) and no fp8 transposed
operand of it; no transposed operand of ``x`` or ``g`` is ever quantized; a producer is asked for rows
only, and its rows give the same results.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from gem_model.api import RowQuantization
from gem_precision import gemm_rates
from gem_precision.formats import E4M3
from gem_precision.recipes import Fp8Recipe
from gem_precision.schemes import Fp8RowwiseScheme, Fp8TensorwiseScheme, MXFP8Scheme
from gem_precision.testing import producer_rows, rel_err

CPU = torch.device("cpu")
IN, OUT, BATCH, TOKENS = 96, 48, 2, 25  # 50 rows: x's transposed operand [96, 50] is unlike W's [96, 48]
Grads = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
Saved = list[tuple[tuple[int, ...], torch.dtype]]


def rowwise(weight_gradient: str, **options: Any) -> Fp8RowwiseScheme:
    return Fp8RowwiseScheme(Fp8RowwiseScheme.Config(backend="emulated", weight_gradient=weight_gradient, **options))


def converted(linear: nn.Linear, weight_gradient: str, **options: Any) -> nn.Module:
    return rowwise(weight_gradient, **options).convert_linear(copy.deepcopy(linear), "blocks.0.out")


def problem(gen: torch.Generator) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """A linear with random weights, and a bf16 input and output gradient (never zeros)."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    linear = nn.Linear(IN, OUT)
    x = torch.randn(BATCH, TOKENS, IN, generator=gen).bfloat16()
    gy = torch.randn(BATCH, TOKENS, OUT, generator=gen).bfloat16()
    assert x.count_nonzero() == x.numel() and gy.count_nonzero() == gy.numel()
    return linear, x, gy


def run(module: nn.Module, x: torch.Tensor, gy: torch.Tensor, *, x_grad: bool = True, **kwargs: Any) -> Grads:
    """``y`` and the gradients of ``x``, the weight and the bias (None where none is asked)."""
    xi = x.detach().clone().requires_grad_(x_grad)
    y = module(xi, **kwargs)
    y.backward(gy)
    return y.detach(), xi.grad, module.weight.grad, module.bias.grad


def bf16_weight_grad(x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """The reference: what the bf16 scheme computes for ``dW`` (bf16 GEMM), in float32 master dtype."""
    return (gy.reshape(-1, OUT).bfloat16().t() @ x.reshape(-1, IN).bfloat16()).float()


@contextmanager
def quantize_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[tuple[int, ...], bool]]]:
    """Every quantization the fp8 recipe runs: (shape of the tensor, whether a transposed operand is made)."""
    calls: list[tuple[tuple[int, ...], bool]] = []
    real = Fp8Recipe._quantize

    def counting(self: Fp8Recipe, t: torch.Tensor, **kwargs: Any) -> Any:
        calls.append((tuple(t.shape), kwargs["cols_t"]))
        return real(self, t, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Fp8Recipe, "_quantize", counting)
        yield calls


def forward_saving(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Saved]:
    """``module(x)``, and the shape and dtype of every tensor its forward saved for backward."""
    saved: Saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return module(x), saved


def test_config_field_validates() -> None:
    assert Fp8RowwiseScheme().config.weight_gradient == "bf16"  # the default since it measured faster
    assert Fp8RowwiseScheme().recipe_for(CPU).high_precision_weight_grad
    assert rowwise("bf16").recipe_for(CPU).high_precision_weight_grad
    assert not rowwise("fp8").recipe_for(CPU).high_precision_weight_grad
    with pytest.raises(ValidationError, match=r"weight_gradient\n.*'fp8' or 'bf16'"):
        Fp8RowwiseScheme.Config(weight_gradient="fp16")
    with pytest.raises(ValidationError, match=r"weight_grad\n.*Extra inputs are not permitted"):
        Fp8RowwiseScheme.Config(weight_grad="bf16")
    # fp8_tensorwise has no such option, and its recipe (like MXFP8's) never computes dW in high precision
    with pytest.raises(ValidationError, match=r"weight_gradient\n.*Extra inputs are not permitted"):
        Fp8TensorwiseScheme.Config(weight_gradient="bf16")
    assert not Fp8TensorwiseScheme().recipe_for(CPU).high_precision_weight_grad
    assert not MXFP8Scheme(MXFP8Scheme.Config(backend="emulated")).recipe_for(CPU).high_precision_weight_grad


def test_bf16_weight_gradient_is_the_bf16_gemm_and_y_dx_are_unchanged(gen: torch.Generator) -> None:
    linear, x, gy = problem(gen)
    fp8 = run(converted(linear, "fp8"), x, gy)
    hp = run(converted(linear, "bf16"), x, gy)
    assert hp[0].dtype == torch.bfloat16 and hp[2] is not None and hp[2].dtype == torch.float32
    for name, got, want in zip(("y", "dx", "db"), (hp[0], hp[1], hp[3]), (fp8[0], fp8[1], fp8[3])):
        assert torch.equal(got, want), name  # the same quantized operands and GEMMs: bitwise
    torch.testing.assert_close(hp[2], bf16_weight_grad(x, gy), rtol=0, atol=0)  # the same bf16 torch.mm
    # and it is not the fp8 GEMM: closer to the float64 product (~1.7e-3) than fp8's (~3.7e-2)
    exact = gy.reshape(-1, OUT).double().t() @ x.reshape(-1, IN).double()
    assert rel_err(hp[2], exact) < 1e-2 < rel_err(fp8[2], exact)


def test_forward_saves_x_as_given_and_no_transposed_operand_of_it(gen: torch.Generator, monkeypatch) -> None:
    linear, x, gy = problem(gen)
    x_t_shape, x2d_shape = (IN, BATCH * TOKENS), (BATCH * TOKENS, IN)
    for weight_gradient in ("fp8", "bf16"):
        with quantize_calls(monkeypatch) as calls:
            y, saved = forward_saving(converted(linear, weight_gradient), x.clone().requires_grad_())
        with quantize_calls(monkeypatch) as backward_calls:
            y.backward(gy)
        made_t = {shape for shape, cols_t in calls + backward_calls if cols_t}
        if weight_gradient == "fp8":  # the check sees what it looks for
            assert (x_t_shape, torch.float8_e4m3fn) in saved and (x2d_shape, torch.bfloat16) not in saved
            assert made_t == {(OUT, IN), x2d_shape, (BATCH * TOKENS, OUT)}  # W, x and g
        else:
            assert (x2d_shape, torch.bfloat16) in saved
            assert not any(shape == x_t_shape for shape, _ in saved)
            assert (IN, OUT) in [shape for shape, dtype in saved if dtype == torch.float8_e4m3fn]  # W.T, for dx
            assert made_t == {(OUT, IN)}  # only the weight's transposed operand, for dx


@pytest.mark.parametrize(
    ("x_grad", "w_grad"), [(True, True), (False, True), (False, False)], ids=["dx_dw_db", "dw_db", "db_only"]
)
def test_bias_gradient_with_and_without_dx(gen: torch.Generator, x_grad: bool, w_grad: bool) -> None:
    """Without dx (an input that takes no gradient) the gradient is quantized for nothing but the bias
    sum; with neither dx nor dW the quantizer is asked for the column sums alone."""
    linear, x, gy = problem(gen)
    linear.weight.requires_grad_(w_grad)
    fp8 = run(converted(linear, "fp8"), x, gy, x_grad=x_grad)
    hp = run(converted(linear, "bf16"), x, gy, x_grad=x_grad)
    assert hp[3] is not None and torch.equal(hp[3], fp8[3])
    torch.testing.assert_close(hp[3], gy.reshape(-1, OUT).float().sum(0), rtol=1e-6, atol=1e-6)
    assert (hp[1] is not None) == x_grad and (hp[2] is not None) == w_grad
    if x_grad:
        assert torch.equal(hp[1], fp8[1])
    if w_grad:
        torch.testing.assert_close(hp[2], bf16_weight_grad(x, gy), rtol=0, atol=0)


@pytest.mark.parametrize("native", [False, True], ids=["reference", "triton"])
def test_column_sums_alone(gen: torch.Generator, native: bool) -> None:
    """What backward asks of the gradient with neither dx nor a quantized dW: both quantizers (the
    Triton one under TRITON_INTERPRET=1) return the float32 column sums and nothing else."""
    recipe = Fp8Recipe("fp8_rowwise", granularity="row", grad_format=E4M3, native=native, fast_accum_forward=False,
                       high_precision_weight_grad=True)  # fmt: skip
    g = torch.randn(37, 40, generator=gen).bfloat16()
    q = recipe.quantize(g, role="grad", rows=False, cols_t=False, col_sum=True)
    assert q.rows is None and q.cols_t is None and q.col_sum is not None and q.col_sum.dtype == torch.float32
    torch.testing.assert_close(q.col_sum, g.float().sum(0), rtol=1e-6, atol=1e-6)


def test_producer_is_asked_for_rows_without_column_maxima() -> None:
    linear = nn.Linear(32, 16)
    hp = converted(linear, "bf16", producer_quantization=True)
    assert hp.input_quantization(CPU) == RowQuantization(column_amax=False)
    assert converted(linear, "fp8", producer_quantization=True).input_quantization(CPU) == RowQuantization(
        column_amax=True
    )
    # rows only when producer_quantization asks (its default)
    assert converted(linear, "bf16", producer_quantization=False).input_quantization(CPU) is None
    assert converted(linear, "bf16").input_quantization(CPU) == RowQuantization(column_amax=False)


@pytest.mark.parametrize("column_amax", [False, True], ids=["rows", "rows_and_unused_maxima"])
def test_prequantized_rows_give_the_same_results(gen: torch.Generator, monkeypatch, column_amax: bool) -> None:
    linear, x, gy = problem(gen)
    module = converted(linear, "bf16", producer_quantization=True)
    want = run(module, x, gy)
    module.weight.grad = module.bias.grad = None
    with quantize_calls(monkeypatch) as calls:
        got = run(module, x, gy, prequantized=producer_rows(x, column_amax=column_amax))
    assert calls and all(shape != (BATCH * TOKENS, IN) for shape, _ in calls)  # x: neither rows nor cols_t
    for name, a, b in zip(("y", "dx", "dw", "db"), got, want):
        assert torch.equal(a, b), name
    torch.testing.assert_close(got[2], bf16_weight_grad(x, gy), rtol=0, atol=0)


def test_rates_time_the_bf16_weight_gradient_gemm(gen: torch.Generator, monkeypatch) -> None:
    roles: list[str] = []
    real = Fp8Recipe.mm
    monkeypatch.setattr(Fp8Recipe, "mm", lambda self, a, b, **kw: roles.append(kw["role"]) or real(self, a, b, **kw))
    linear, x, gy = problem(gen)
    seconds = gemm_rates._gemm_seconds(rowwise("bf16"), linear, x.reshape(-1, IN), gy.reshape(-1, OUT), CPU)
    assert seconds is not None and seconds > 0
    assert roles and "grad_weight" not in roles and {"forward", "grad_input"} <= set(roles)
