"""The module that replaces an ``nn.Linear`` under a scaled (fp8 / MXFP8) scheme, and its autograd.

:class:`ScaledLinearFunction` computes the three GEMMs of a linear itself:

- forward ``y = x @ W.T (+ b)``: ``x`` and ``W`` quantized along ``in_features``;
- ``dx = g @ W``: ``g`` quantized along ``out_features``, ``W.T`` along ``out_features``;
- ``dW = g.T @ x``: ``g.T`` and ``x.T`` quantized along the tokens.

The transposed operands of ``x`` and ``W`` come out of the forward quantization (same read) and are
what is saved for backward (fp8, not the high-precision input); ``g`` is quantized once for both
backward GEMMs, and on the fused fp8 path the bias gradient comes from that same read.

Under ``fp8_rowwise`` the row operand of ``x`` may come from the kernel that produced ``x``
(``gem_model.api.PrequantizedRows``, asked for by :meth:`ScaledLinear.input_quantization`): then only
``x``'s transposed operand is made here, by its cast pass alone when the producer wrote the column
maxima too.

Under ``fp8_rowwise`` with ``weight_gradient: bf16`` (or ``fp8_blocks``) and e4m3 gradients, the row
operand of ``g`` (and its column sums, for the bias) may come from the kernel that wrote ``g`` in backward
(``gem_model.api.GradRowsSlot``, made by :meth:`ScaledLinear.grad_rows_slot`): then backward quantizes
nothing for ``dx`` and the bias.

Under ``fp8_rowwise`` with ``weight_gradient: bf16`` (:attr:`LinearRecipe.high_precision_weight_grad`)
the weight gradient is a plain GEMM in the activation dtype, ``dW = g.T @ x`` with float32
accumulation, as the ``bf16`` scheme computes it: the forward quantizes only ``x``'s rows (or takes
them from the producer, without column maxima) and saves ``x`` as given instead of its transposed
operand; backward quantizes only ``g``'s rows, for ``dx``. No transposed operand of ``x`` or ``g`` is
made, at the price of a bf16 GEMM in place of an fp8 one. ``y`` and ``dx`` are what they are without
the option. ``weight_gradient: fp8_blocks`` (:attr:`LinearRecipe.block_scaled_weight_grad`) is the same
but for ``dW``: backward makes both of its operands from ``g`` and the saved ``x``, in e4m3 with 1 x 128
block scales, for an fp8 GEMM (:mod:`gem_precision.blockwise_weight_grad`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gem_model.api import GradRows, GradRowsSlot, PrequantizedRows, RowQuantization
from gem_precision.bf16_linear import SchemeLinear, float32_weight_grad
from gem_precision.blockwise_weight_grad import block_scaled_weight_grad
from gem_precision.recipes import Fp8Recipe, LinearRecipe, Quantized


class ScaledLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        recipe: LinearRecipe,
        prequantized: PrequantizedRows | None = None,
        grad_rows: GradRowsSlot | None = None,
    ) -> torch.Tensor:
        out_features, in_features = weight.shape
        x2d = x.reshape(-1, in_features).contiguous()
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        hp_dw = recipe.high_precision_weight_grad
        xq = _quantize_input(recipe, x2d, prequantized, cols_t=need_dw and not hp_dw)
        wq = recipe.quantize(weight.contiguous(), role="weight", rows=True, cols_t=need_dx)
        y = recipe.mm(xq.rows, wq.rows, out_dtype=x.dtype, role="forward", bias=bias)
        saved: list[torch.Tensor] = []
        if need_dw:  # x as given for a high-precision weight gradient, else its transposed operand
            saved += [x2d] if hp_dw else xq.cols_t.tensors()
        if need_dx:
            saved += wq.cols_t.tensors()
        ctx.save_for_backward(*saved)
        ctx.recipe, ctx.hp_dw, ctx.grad_rows = recipe, hp_dw, grad_rows
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y.view(*x.shape[:-1], out_features)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        recipe: LinearRecipe = ctx.recipe
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        saved = list(ctx.saved_tensors)
        w_t = recipe.operand_type(*saved[-2:]) if need_dx else None
        g2d = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        cols_t = need_dw and not ctx.hp_dw
        offered = ctx.grad_rows.take(g2d) if ctx.grad_rows is not None else None
        gq = _offered_grad(recipe, g2d, offered, cols_t=cols_t, col_sum=need_db)
        if gq is None:
            gq = _quantize_grad(recipe, g2d, rows=need_dx, cols_t=cols_t, col_sum=need_db)
        dx = dw = db = None
        if need_dx:
            dx = recipe.mm(gq.rows, w_t, out_dtype=ctx.x_dtype, role="grad_input").view(ctx.x_shape)
        if need_dw and ctx.hp_dw:
            dw = _weight_grad_from_saved_input(recipe, g2d, saved[0]).to(ctx.w_dtype)
        elif need_dw:
            x_t = recipe.operand_type(*saved[:2])
            dw = recipe.mm(gq.cols_t, x_t, out_dtype=torch.float32, role="grad_weight").to(ctx.w_dtype)
        if need_db:
            db = gq.col_sum.to(ctx.bias_dtype)
        return dx, dw, db, None, None, None


def _quantize_input(
    recipe: LinearRecipe, x2d: torch.Tensor, prequantized: PrequantizedRows | None, *, cols_t: bool
) -> Quantized:
    """``x``'s row operand (quantized here, or the producer's rows) and, with ``cols_t``, its transposed one."""
    if prequantized is None:
        return recipe.quantize(x2d, role="input", rows=True, cols_t=cols_t)
    return recipe.quantize_prequantized(x2d, prequantized, cols_t=cols_t)


def _quantize_grad(recipe: LinearRecipe, g2d: torch.Tensor, *, rows: bool, cols_t: bool, col_sum: bool) -> Quantized:
    """One quantization of ``g`` for both backward GEMMs and the bias gradient; none when nothing is asked
    (a high-precision weight gradient and no ``dx`` nor bias gradient). With only ``col_sum`` asked, every
    recipe's quantizer returns the float32 column sums alone (the Triton one from its stats pass)."""
    if not (rows or cols_t or col_sum):
        return Quantized(None, None)
    return recipe.quantize(g2d, role="grad", rows=rows, cols_t=cols_t, col_sum=col_sum)


def _offered_grad(
    recipe: LinearRecipe, g2d: torch.Tensor, offered: GradRows | None, *, cols_t: bool, col_sum: bool
) -> Quantized | None:
    """``g``'s row operand as its producer wrote it (``offered``), with the column sums it offered (or,
    when it left them out, summed here: one torch reduction, no quantization pass); None when there is
    no offer, or backward needs a transposed operand."""
    if offered is None or cols_t:
        return None
    rows = recipe.quantize_prequantized(g2d, offered.rows, cols_t=False).rows
    sums = None
    if col_sum:
        sums = offered.column_sum if offered.column_sum is not None else g2d.sum(0, dtype=torch.float32)
    return Quantized(rows, None, sums)


def _weight_grad_from_saved_input(recipe: LinearRecipe, g2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """``g.T @ x`` as a float32 tensor, on the unquantized gradient and the input the forward saved
    (:attr:`LinearRecipe.high_precision_weight_grad`). With :attr:`LinearRecipe.block_scaled_weight_grad`, an
    e4m3 GEMM on operands with 1 x 128 block scales made here from both
    (:func:`gem_precision.blockwise_weight_grad.block_scaled_weight_grad`); else from operands in ``x``'s dtype
    (bf16 operands and float32 accumulation in practice), written in float32 by the GEMM on a GPU, as the
    ``bf16`` scheme's weight gradient (:func:`gem_precision.bf16_linear.float32_weight_grad`)."""
    if isinstance(recipe, Fp8Recipe) and recipe.block_scaled_weight_grad:
        return block_scaled_weight_grad(g2d, x2d, native=recipe.native)
    return float32_weight_grad(g2d.to(x2d.dtype), x2d)


class ScaledLinear(SchemeLinear):
    """Drop-in for an ``nn.Linear`` whose GEMMs run scaled (fp8, MXFP8).

    Holds the original ``weight`` and ``bias`` Parameters (float32 master weights, same names). The
    recipe is chosen per device at the first forward on it (``recipe_for``), since the core converts
    linears before the model is moved to its device. The output has the dtype of the input.
    """

    def __init__(self, linear: nn.Linear, *, scheme: str, fqn: str, recipe_for: Callable[[torch.device], LinearRecipe]):
        super().__init__(linear, fqn=fqn)
        self.scheme = scheme
        self._recipe_for = recipe_for

    def recipe(self, device: torch.device) -> LinearRecipe:
        recipe = self._recipe_for(device)
        problem = recipe.shape_problem(self.in_features, self.out_features)
        if problem:
            raise ValueError(
                f"{self.fqn}: precision scheme {self.scheme!r} (backend {recipe.backend!r}) cannot run this "
                f"linear: {problem}. Leave it out with precision.exclude or precision.min_dim, or use "
                "backend 'emulated'"
            )
        return recipe

    def input_quantization(self, device: torch.device) -> RowQuantization | None:
        """What this linear takes pre-quantized of its input on ``device`` (``gem_model.api``'s
        ``PrequantizedInputLinear``): the e4m3 rows under ``fp8_rowwise`` (both backends), with the
        column maxima when the weight gradient will be computed (its transposed operand is scaled per
        column); None under ``fp8_tensorwise`` and ``mxfp8``, whose scales no row's producer can write
        (:attr:`LinearRecipe.takes_prequantized_rows`). With a high-precision weight gradient
        (``weight_gradient: bf16`` or ``fp8_blocks``) never the column maxima: no transposed operand of ``x`` is
        made in the forward."""
        recipe = self.recipe(device)
        if not recipe.takes_prequantized_rows:
            return None
        if recipe.high_precision_weight_grad:
            return RowQuantization(column_amax=False)
        return RowQuantization(column_amax=torch.is_grad_enabled() and self.weight.requires_grad)

    def grad_rows_slot(self, device: torch.device) -> GradRowsSlot | None:
        """The slot through which this linear's backward takes its output gradient's e4m3 rows (and column
        sums, when the bias takes a gradient) from the kernel that wrote that gradient
        (``gem_model.api.GradRowsSlot``): under ``fp8_rowwise`` with producer quantization, the weight
        gradient from the unquantized gradient (``weight_gradient: bf16`` or ``fp8_blocks``: the gradient's
        quantization makes no transposed operand) and e4m3 gradients; else None."""
        recipe = self.recipe(device)
        if not (recipe.takes_prequantized_rows and recipe.high_precision_weight_grad and recipe.grad_rows_in_rule):
            return None
        return GradRowsSlot(column_sum=self.bias is not None and self.bias.requires_grad)

    def forward(
        self, x: torch.Tensor, *, prequantized: PrequantizedRows | None = None, grad_rows: GradRowsSlot | None = None
    ) -> torch.Tensor:
        """``prequantized``: ``x`` quantized as :meth:`input_quantization` asked, by the kernel that wrote
        ``x``; the forward GEMM then uses those bits and only the weight gradient's operand is made here
        (the same bits and outputs as without them). ``grad_rows``: the slot :meth:`grad_rows_slot` made,
        which backward takes the output gradient's rows from when its producer offered them."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{self.fqn}: expected input with last dim {self.in_features}, got shape {tuple(x.shape)}")
        if x.numel() == 0:  # nothing to scale; keeps empty batches out of the kernels
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.to(x.dtype), bias)
        recipe = self.recipe(x.device)
        if prequantized is not None:
            if not recipe.takes_prequantized_rows:
                raise ValueError(
                    f"{self.fqn}: precision scheme {self.scheme!r} (backend {recipe.backend!r}) takes no "
                    "pre-quantized input rows (its input_quantization is None); call it with x alone"
                )
            prequantized.check_input(x, self.fqn)
        if grad_rows is not None and not isinstance(grad_rows, GradRowsSlot):
            raise TypeError(f"{self.fqn}: grad_rows must be a GradRowsSlot, got {type(grad_rows).__name__}")
        return ScaledLinearFunction.apply(x, self.weight, self.bias, recipe, prequantized, grad_rows)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scheme={self.scheme}"
        )
