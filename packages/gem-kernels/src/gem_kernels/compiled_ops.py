"""The Triton kernels as ``torch.library`` custom ops, for ``torch.compile`` (imports triton).

Under ``torch.compile`` the jagged attention and the norm-gate are called through these ops instead
of their autograd functions. Dynamo then sees one opaque call with a declared output shape and
layout (its fake implementation) and does not trace into the launchers. Inductor fuses the pointwise
work around the calls: the silu of the uvqk projection, the split and its backward concatenation,
the layer norm and the residual. Eager calls keep the autograd functions, which cost the host less
per call. Both paths run the same kernels, so they give the same numbers.

Every output is a new contiguous tensor, in the kernels and in the fake implementations alike.
The two must agree, because compiled code asserts the strides it was compiled for.
"""

from __future__ import annotations

from typing import Any

import torch

from gem_kernels.attention_triton import query_major
from gem_kernels.attention_triton_autograd import _unit_stride, attention_backward
from gem_kernels.attention_triton_bias import prepare_bias
from gem_kernels.norm_gate_triton import NormGateFunction, norm_gate_backward

Tensor = torch.Tensor
EMPTY_SHAPE = (0,)


def _blocks(block_m: int, block_n: int) -> tuple[int, int] | None:
    return None if block_m == 0 else (block_m, block_n)


@torch.library.custom_op("gem_kernels::jagged_attention", mutates_args=())
def jagged_attention_op(
    q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, num_targets: Tensor | None,
    position_bias: Tensor | None, time_bias: Tensor | None, timestamps: Tensor | None,
    query_timestamps: Tensor | None, max_seq_len: int, alpha: float, max_attn_len: int,
    dq_mode: str, block_m: int, block_n: int,
) -> Tensor:
    """The forward of :func:`gem_kernels.attention_triton_autograd.jagged_attention_triton`
    (``block_m = 0``: tuned tiles; ``dq_mode`` is for the backward)."""
    bias = prepare_bias(position_bias, time_bias, timestamps, query_timestamps, max_seq_len)
    return query_major(
        _unit_stride(q), _unit_stride(k), _unit_stride(v), None, seq_offsets, num_targets,
        max_seq_len=max_seq_len, alpha=alpha, max_attn_len=max_attn_len, blocks=_blocks(block_m, block_n), bias=bias,
    )


@jagged_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, *args: Any) -> Tensor:
    return v.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op("gem_kernels::jagged_attention_backward", mutates_args=())
def jagged_attention_backward_op(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, num_targets: Tensor | None,
    position_bias: Tensor | None, time_bias: Tensor | None, timestamps: Tensor | None,
    query_timestamps: Tensor | None, max_seq_len: int, alpha: float, max_attn_len: int,
    dq_mode: str, block_m: int, block_n: int, needs_position: bool, needs_time: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``dq, dk, dv, d_position_bias, d_time_bias``; a bias gradient not asked for is empty ``[0]``."""
    bias = prepare_bias(position_bias, time_bias, timestamps, query_timestamps, max_seq_len)
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    dq, dk, dv, d_position, d_time = attention_backward(
        grad_out, q, k, v, seq_offsets, num_targets, bias, max_seq_len=max_seq_len, alpha=alpha,
        max_attn_len=max_attn_len, dq_mode=dq_mode, blocks=_blocks(block_m, block_n),  # type: ignore[arg-type]
        needs_position=needs_position, needs_time=needs_time,
    )
    tables = []
    for grad, table in ((d_position, position_bias), (d_time, time_bias)):
        tables.append(q.new_empty(EMPTY_SHAPE) if grad is None or table is None else grad.to(table.dtype))
    return dq, dk, dv, tables[0], tables[1]


@jagged_attention_backward_op.register_fake
def _(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, seq_offsets: Tensor, num_targets: Tensor | None,
    position_bias: Tensor | None, time_bias: Tensor | None, *args: Any,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    needs_position, needs_time = args[-2], args[-1]
    tables = []
    for needed, table in ((needs_position, position_bias), (needs_time, time_bias)):
        tables.append(q.new_empty(EMPTY_SHAPE) if not needed or table is None else table.new_empty(table.shape))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), tables[0], tables[1]


_ATTENTION_TENSORS = 9  # q, k, v, seq_offsets, num_targets, position_bias, time_bias, timestamps, query_ts


def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    ctx.save_for_backward(*inputs[:_ATTENTION_TENSORS])
    ctx.params = inputs[_ATTENTION_TENSORS:]


def _attention_backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
    tensors = ctx.saved_tensors
    needs_position = ctx.needs_input_grad[5] and tensors[5] is not None
    needs_time = ctx.needs_input_grad[6] and tensors[6] is not None
    dq, dk, dv, d_position, d_time = jagged_attention_backward_op(
        grad_out, *tensors, *ctx.params, needs_position, needs_time
    )
    rest = (None,) * (len(ctx.needs_input_grad) - 7)
    return (dq, dk, dv, None, None, d_position if needs_position else None, d_time if needs_time else None, *rest)


jagged_attention_op.register_autograd(_attention_backward, setup_context=_attention_setup)


@torch.library.custom_op("gem_kernels::norm_gate", mutates_args=())
def norm_gate_op(x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``y, mean, rstd`` of :func:`gem_kernels.norm_gate_triton.norm_gate_triton` (the statistics
    are outputs so that the backward can read them)."""
    return NormGateFunction.run_forward(x, u, weight, bias, eps)


@norm_gate_op.register_fake
def _(x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    rows = x.numel() // max(1, x.shape[-1]) if x.dim() else 1
    stats = x.new_empty((rows,), dtype=torch.float32)
    return x.new_empty(x.shape), stats, x.new_empty((rows,), dtype=torch.float32)


@torch.library.custom_op("gem_kernels::norm_gate_backward", mutates_args=())
def norm_gate_backward_op(
    dy: Tensor, x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, mean: Tensor, rstd: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``dx, du, d_weight, d_bias``."""
    return norm_gate_backward(dy, x, u, weight, bias, mean, rstd)


@norm_gate_backward_op.register_fake
def _(dy: Tensor, x: Tensor, u: Tensor, weight: Tensor, bias: Tensor, *args: Any) -> tuple[Tensor, ...]:
    return x.new_empty(x.shape), u.new_empty(u.shape), weight.new_empty(weight.shape), bias.new_empty(bias.shape)


def _norm_gate_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor, Tensor]) -> None:
    x, u, weight, bias, _ = inputs
    ctx.save_for_backward(x, u, weight, bias, output[1], output[2])


def _norm_gate_backward(ctx: Any, dy: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
    dx, du, dw, db = norm_gate_backward_op(dy, *ctx.saved_tensors)
    return dx, du, dw, db, None


norm_gate_op.register_autograd(_norm_gate_backward, setup_context=_norm_gate_setup)
