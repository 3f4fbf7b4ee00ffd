"""Tensor parallelism in the HSTU blocks, with DTensor ``parallelize_module``: heads split over ``tp``.

One block (:mod:`gem_model.model.hstu`) is ``u, v, q, k = split(silu(uvqk(ln(x))))``, attention per
head, ``y = norm_gate(a, u)``, ``x + out(y)``. Over a ``tp`` group of ``T`` ranks, rank ``r`` holds
heads ``r*H/T .. (r+1)*H/T``:

- ``uvqk``: ``ColwiseParallel``. Its output rows are ``[u | v | q | k]`` with the heads inside each,
  so the rows are first permuted to ``[u_0 v_0 q_0 k_0 | u_1 v_1 q_1 k_1 | ...]`` (rank ``r``'s
  contiguous shard holds its own heads' four parts). The model is the same function; only the row
  order of ``uvqk`` in the state dict differs from an unsharded model's, so a checkpoint of a
  ``tp`` layout is resumed under the same ``tp``;
- the attention runs on the local heads; the relative position / time biases are shared by the
  heads, so their gradient is summed over the group (identity forward, all-reduce backward);
- ``norm_gate``: its layer norm spans every head's features, so its statistics (mean, variance)
  are all-reduced over the group and each rank normalises its own slice (torch ops here, not the
  ``norm_gate`` kernel); the gate's weight and bias are sliced, their gradients summed;
- ``out``: ``RowwiseParallel``: the local slice in, the partial products all-reduced, the block's
  output replicated over the group.

Every rank of a ``tp`` group reads the same samples (the layout's data-parallel rank excludes ``tp``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from gem_model.api import NO_EXTRAS, ShardableModel

_BLOCK_PARTS = ("uvqk", "out", "num_heads", "value_dim", "attention_dim", "attention", "norm_gate")


def _blocks(model: ShardableModel, where: str) -> list[tuple[str, nn.Module]]:
    out = []
    for fqn in model.activation_blocks():
        block = model.get_submodule(fqn)  # type: ignore[attr-defined]
        missing = [a for a in _BLOCK_PARTS if not hasattr(block, a)]
        if missing:
            raise ValueError(f"{where}: block {fqn!r} is not an HSTU block (it has no {missing}); tensor parallelism splits HSTU blocks")
        out.append((fqn, block))
    return out


def check_tensor_parallel(model: ShardableModel, tp: int, *, where: str) -> None:
    """Raise ValueError naming ``where`` when ``tp`` does not divide every block's heads."""
    for fqn, block in _blocks(model, where):
        if block.num_heads % tp:
            raise ValueError(f"{where} = {tp} must divide model.num_heads = {block.num_heads} (block {fqn!r})")
        for part in ("uvqk", "out"):
            linear = getattr(block, part)
            if not isinstance(linear, nn.Linear):
                raise ValueError(
                    f"{where} = {tp}: {fqn}.{part} is a {type(linear).__name__} (the precision scheme converted it), "
                    "and DTensor tensor parallelism splits nn.Linear only; keep the blocks' uvqk and out in float32 "
                    "(precision.exclude: ['blocks.*.uvqk', 'blocks.*.out']) or run without tp"
                )


def apply_tensor_parallel(model: ShardableModel, tp_mesh: DeviceMesh) -> None:
    """Split every HSTU block's heads over ``tp_mesh`` (in place)."""
    tp, rank, group = tp_mesh.size(), tp_mesh.get_local_rank(), tp_mesh.get_group()
    check_tensor_parallel(model, tp, where="tp")
    for _, block in _blocks(model, "tp"):
        h, dv, dqk = block.num_heads, block.value_dim, block.attention_dim
        _permute_rows(block.uvqk, _head_major_rows(h, dv, dqk, tp))
        parallelize_module(block, tp_mesh, {"uvqk": ColwiseParallel(), "out": RowwiseParallel()})
        block.num_heads = h // tp
        block.attention = _SharedBiasAttention(block.attention, group)
        block.norm_gate = _GroupNormGate(block.norm_gate, group, rank=rank, width=(h // tp) * dv)
        # the wrappers offer no fused block (JaggedAttentionKernel.fused_block), so the split blocks
        # run op by op: the norm-gate's layer norm spans the tp group and the bias gradients sum over it


def _head_major_rows(h: int, dv: int, dqk: int, tp: int) -> torch.Tensor:
    """Row order of ``uvqk`` that gives each tp rank its heads' ``u, v, q, k`` contiguously."""
    starts = [0, h * dv, 2 * h * dv, 2 * h * dv + h * dqk]  # where u, v, q, k begin
    widths = [dv, dv, dqk, dqk]
    hl = h // tp
    rows = [
        torch.arange(start + r * hl * w, start + (r + 1) * hl * w)
        for r in range(tp)
        for start, w in zip(starts, widths, strict=True)
    ]
    return torch.cat(rows)


@torch.no_grad()
def _permute_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    linear.weight.copy_(linear.weight[rows.to(linear.weight.device)])
    if linear.bias is not None:
        linear.bias.copy_(linear.bias[rows.to(linear.bias.device)])


class _SumGradOverGroup(torch.autograd.Function):
    """Identity forward; the gradient summed over ``group`` (each rank holds a part of it)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _shared(x: torch.Tensor | None, group: Any) -> torch.Tensor | None:
    return None if x is None else _SumGradOverGroup.apply(x, group)


class _SharedBiasAttention:
    """The block's attention kernel on its local heads; the heads' shared biases sum their gradients."""

    def __init__(self, kernel: Any, group: Any):
        self.kernel, self.group = kernel, group
        self.name = kernel.name

    def __call__(self, q, k, v, seq_offsets, *, extras=NO_EXTRAS, **kw):  # type: ignore[no-untyped-def]
        shared = dataclasses.replace(
            extras, position_bias=_shared(extras.position_bias, self.group),
            time_bias=_shared(extras.time_bias, self.group),
        )
        return self.kernel(q, k, v, seq_offsets, extras=shared, **kw)


class _GroupNormGate:
    """``layer_norm(x) * weight + bias`` times ``u`` where ``x`` and ``u`` are this rank's slice of the
    features: the norm's statistics are all-reduced over the group (in float32)."""

    def __init__(self, kernel: Any, group: Any, *, rank: int, width: int):
        self.kernel, self.group, self.width = kernel, group, width
        self.name = kernel.name
        self.start = rank * width
        self.total = width * dist.get_world_size(group)

    def __call__(self, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        mean = dist_fn.all_reduce(xf.sum(-1, keepdim=True), group=self.group) / self.total
        centred = xf - mean
        var = dist_fn.all_reduce(centred.square().sum(-1, keepdim=True), group=self.group) / self.total
        w = _shared(weight, self.group)[self.start : self.start + self.width]  # type: ignore[index]
        b = _shared(bias, self.group)[self.start : self.start + self.width]  # type: ignore[index]
        y = centred * torch.rsqrt(var + eps) * w.float() + b.float()
        return (y.to(x.dtype) * u).to(x.dtype)
