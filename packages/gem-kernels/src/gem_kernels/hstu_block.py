"""The HSTU block fused around its two linears: what gem-kernels' ``triton`` attention kernel offers as
:meth:`~gem_model.components.JaggedAttentionKernel.fused_block` (imports triton).

    ln, skip, _ = norm_fork(x)                   # layer norm + the residual branch (layer_norm_triton)
    y, _ = hstu_gap(uvqk(ln), gate_weight, ...)  # silu, split, attention, norm-gate (hstu_gap_triton)
    return skip + out(y)

The linears are the block's own modules (the precision scheme's GEMMs), called in between. What the
fusion removes, per block: the silu passes and the concatenation of the four gradients around the
attention, the ``silu(u)`` tensor, and the pass that adds the residual's gradient to the layer norm's.

A linear that wants its input pre-quantized (``gem_model.api.wanted_quantization``: gem-precision's
``fp8_rowwise``) gets the e4m3 rows of ``ln`` from the layer norm's pass and those of ``y`` from the
norm-gate's, instead of quantizing them itself (one read of the activation, or two, fewer a linear).

``saved_format="e4m3_row"`` (from the block's activation policy) reaches the gap, which then keeps
its pre-activation in e4m3 rows (:mod:`gem_kernels.hstu_gap_saved`), and the layer norm, whose
backward then reads ``ln`` (kept by ``uvqk`` anyway) instead of ``x``: ``x`` is not kept at all.
(``wanted_quantization``'s rows are asked for only under ``fp8_rowwise``'s ``producer_quantization``.)

In backward, a linear that makes a ``gem_model.api.GradRowsSlot`` (``grad_rows_slot``: the same scheme,
with its bf16 weight gradient) gets its output gradient's e4m3 rows, and column sums for its bias,
from the kernel that wrote that gradient: ``uvqk`` from the gap's last backward pass
(:mod:`gem_kernels.hstu_gap_grad_rows`), ``out`` from the next block's layer norm backward, through
the residual add, which hands the gradient on unchanged (the block's output carries ``out``'s slot,
``attach_grad_rows``; the last block's output goes elsewhere, and its ``out`` quantizes its gradient
itself). A slot that asks for the column sums alone (the ``bf16`` scheme's ``out``: its bias gradient)
is served the same way by the next block's layer norm backward; ``uvqk``'s bias gradient is the gap's
(``bias_grad_in_gap``), so the gap is handed only slots that ask for rows.

A linear that takes a supplied forward GEMM (``gem_model.api.takes_gemm``: the ``bf16`` scheme's) may
run gem-kernels' own (:mod:`gem_kernels.linear_epilogue_triton`), with the work beside it in the
epilogue: ``uvqk``'s writes ``silu(v, q, k)`` for the gap (:data:`LINEAR_SILU`), ``out``'s adds the
residual (:data:`LINEAR_RESIDUAL`). The scheme keeps its weights, casts and backward.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch

from gem_kernels.hstu_gap_triton import hstu_gap_triton
from gem_kernels.layer_norm_triton import norm_fork
from gem_kernels.linear_epilogue_triton import DEFAULT_CONFIG, fits_epilogue, linear_residual, linear_silu
from gem_model.api import (
    GradRowsSlot,
    attach_grad_rows,
    attached_grad_rows,
    bias_grad_elsewhere,
    call_linear,
    grad_rows_slot,
    takes_gemm,
    wanted_quantization,
)

LINEAR_RESIDUAL = True
"""Whether an ``out`` linear that takes a supplied GEMM runs
:func:`gem_kernels.linear_epilogue_triton.linear_residual`, which adds the residual in its epilogue, in
place of cuBLAS and the add (e2e switch ``residual_add`` gives cuBLAS and the add back). On the H200
(2026-12-05) the GEMM and add took 0.864 ms against cuBLAS's 0.971 at 207,000 rows
(``benchmarks/linear_epilogue.py``), but the step alone moved 1.003x, inside what the benchmark resolves.
On the H100 (2026-12-06) it moved 1.003x alone (steady 1.005x), and with the unit-rows and bias-gradient
kernels 1.009x / 1.015x / 1.013x on three seeds against 1.005x / 1.007x for those two without it
(``benchmarks/results/e2e_ab.md``). On since 2026-12-06."""
UVQK_CONFIG = DEFAULT_CONFIG
"""The tiles of uvqk's GEMM (:data:`gem_kernels.linear_epilogue_triton.CONFIGS`): the fastest with ``post``
on the H200 (2026-12-05)."""
OUT_CONFIG = "m256n128k64"
"""The tiles of out's GEMM: the fastest with the residual on the H200 at 207,000 rows (2026-12-05; 0.864 ms
against 0.901 for ``m128n256k64``)."""
LINEAR_SILU = False
"""Whether a ``uvqk`` linear that takes a supplied GEMM (the ``bf16`` scheme's) runs
:func:`gem_kernels.linear_epilogue_triton.linear_silu`, whose epilogue writes ``silu(v, q, k)`` beside
``pre``, in place of cuBLAS and the gap's silu pass (e2e switch ``linear_silu``). Off: slower on the H200
(2026-12-05, ``benchmarks/linear_epilogue.py`` at 207,000 rows): 3.593 ms against 3.209 for cuBLAS and the
pass (0.893x). The GEMM alone runs at 627 TFLOP/s to cuBLAS's 706, and writing ``post`` adds 0.82 ms where
its bytes take ~0.3: the epilogue's stores are not overlapped with the next tile's MMAs (one partition,
no asynchronous stores), which a warp-specialized GEMM would need."""


def hstu_block_triton(
    x: torch.Tensor,
    uvqk: Callable[[torch.Tensor], torch.Tensor],
    out: Callable[[torch.Tensor], torch.Tensor],
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    seq_offsets: torch.Tensor,
    *,
    bias_grad_in_gap: bool = False,
    **gap_options: Any,
) -> torch.Tensor:
    """``x + out(gap(uvqk(layer_norm(x))))`` (``out``'s result in ``x``'s dtype); ``gap_options`` as
    :func:`hstu_gap_triton` takes them. ``bias_grad_in_gap``: the gap's backward passes sum the gradient
    of ``uvqk``'s bias as they write its output's gradient, and ``uvqk`` does not (:mod:`gem_kernels.hstu_gap_bias`)."""
    # under a saved-activation format the layer norm's backward reads ln (which uvqk keeps anyway), not x
    keep_output = gap_options.get("saved_format") is not None
    ln, skip, ln_rows = norm_fork(x, quantize=wanted_quantization(uvqk, x.device), keep_output=keep_output,
                                  grad_rows=attached_grad_rows(x))  # the previous block's out linear's slot
    with bias_grad_elsewhere(uvqk) if bias_grad_in_gap else nullcontext() as pre_bias:
        slot = grad_rows_slot(uvqk, x.device)  # asked with the bias lent, so no column sums for it
        slot = slot if slot is not None and slot.rows else None  # the gap's last pass offers rows
        post = _epilogue_post(uvqk, ln, ln_rows, slot, gap_options)
        gemm = None if post is None else partial(_linear_silu_into, post=post)
        pre = call_linear(uvqk, ln, ln_rows, slot, gemm)
    y, y_rows = hstu_gap_triton(pre, gate_weight, gate_bias, seq_offsets, quantize=wanted_quantization(out, x.device),
                                pre_bias=pre_bias, grad_rows=slot, post=post, **gap_options)  # fmt: skip
    out_slot = grad_rows_slot(out, x.device)
    if _residual_epilogue(out, y, y_rows, out_slot, skip):  # the residual added in out's GEMM epilogue
        summed = call_linear(out, y, None, out_slot, partial(_linear_residual_into, residual=skip))
        result = ResidualInEpilogue.apply(summed, skip)
    else:
        result = skip + call_linear(out, y, y_rows, out_slot).to(x.dtype)
    if out_slot is not None:  # the next block's layer norm writes result's gradient: out's, through the add
        attach_grad_rows(result, out_slot)
    return result


def _epilogue_post(uvqk: Callable[..., torch.Tensor], ln: torch.Tensor, ln_rows: object, slot: object,
                   gap_options: dict[str, Any]) -> torch.Tensor | None:  # fmt: skip
    """The buffer for ``silu(pre[:, H Dv:])`` when the uvqk GEMM's epilogue writes it (:data:`LINEAR_SILU`,
    a linear that takes a supplied GEMM, its input not pre-quantized, no saved format or fp8 forward,
    whose silu passes write more), else None."""
    if not LINEAR_SILU or ln_rows is not None or slot is not None or not ln.numel() or ln.dim() != 2:
        return None
    if gap_options.get("saved_format") is not None or gap_options.get("fp8_forward") or not takes_gemm(uvqk, ln):
        return None
    hv = gap_options["num_heads"] * gap_options["value_dim"]
    width = gap_options["num_heads"] * (2 * gap_options["value_dim"] + 2 * gap_options["attention_dim"])
    if not fits_epilogue(hv, width, ln.shape[1], UVQK_CONFIG) or ln.dtype != torch.bfloat16:
        return None
    return torch.empty((ln.shape[0], width - hv), dtype=ln.dtype, device=ln.device)


def _linear_silu_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                      post: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The :data:`gem_model.api.LinearGemm` handed to uvqk: its ``pre``, with ``post`` (the silu of its last
    ``post.shape[1]`` columns) written beside it."""
    return linear_silu(x, weight, bias, weight.shape[0] - post.shape[1], post=post, config=UVQK_CONFIG)[0]


def _residual_epilogue(out: Callable[..., torch.Tensor], y: torch.Tensor, y_rows: object, slot: object,
                       skip: torch.Tensor) -> bool:  # fmt: skip
    """Whether ``out``'s GEMM adds the residual (:data:`LINEAR_RESIDUAL`, a linear that takes a supplied GEMM,
    bf16 rows, its input not pre-quantized and its output gradient not asked for in rows)."""
    asks_rows = isinstance(slot, GradRowsSlot) and slot.rows
    if not LINEAR_RESIDUAL or y_rows is not None or asks_rows or y.dim() != 2 or not y.shape[0]:
        return False
    if y.dtype != torch.bfloat16 or skip.dtype != torch.bfloat16 or not skip.is_contiguous():
        return False
    return fits_epilogue(0, skip.shape[1], y.shape[1], OUT_CONFIG) and takes_gemm(out, y)


def _linear_residual_into(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *,
                          residual: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The :data:`gem_model.api.LinearGemm` handed to ``out``: ``residual + F.linear(x, weight, bias)``."""
    return linear_residual(x, weight, bias, residual.detach(), config=OUT_CONFIG)


class ResidualInEpilogue(torch.autograd.Function):
    """``summed`` (``out``'s output, the residual already added in its GEMM's epilogue) as the block's
    output, with the residual's gradient routed back to it: the same gradient as ``summed``'s."""

    @staticmethod
    def forward(ctx: Any, summed: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return summed

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return grad, grad
