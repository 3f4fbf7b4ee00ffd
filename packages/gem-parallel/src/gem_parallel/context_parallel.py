"""Context parallelism for the jagged HSTU blocks: each sequence's rows split over the ``cp`` ranks.

torch's ``context_parallel`` takes dense ``[B, H, S, D]`` inputs, not jagged ones, so this is our own.
The ranks of a ``cp`` group read the same samples. Around every HSTU block (forward hooks, so no
parameter is renamed):

- **Balanced slices (head-tail).** Each sequence of ``n`` rows is cut into ``2 * cp`` chunks
  (bounds ``i * n // (2 * cp)``); rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``. Causal
  attention costs a query its position, so a head chunk (cheap) pairs with a tail chunk (dear),
  and every rank gets the same share of each sequence's work (:func:`head_tail_rows`).
- **The block runs on the local rows only**: layer norm, ``uvqk``, ``norm_gate`` and ``out`` are
  row-wise. Its attention (:class:`ContextParallelAttention`) computes the local queries against
  every key of their sequence: K and V are all-gathered within the cp group (with autograd: the
  backward reduce-scatters the key gradients, summing what every rank's queries gave each key).
- **Out of the block** the rows are put back together (one all-reduce of the zero-filled rows),
  so the model around the blocks, and the loss, are computed whole on every cp rank.

Gradients. The rows' gradient leaving a block is all-reduced over the group (each rank contributes
its own rows). A block parameter's gradient is a sum over the group's ranks of their rows'
parts; FSDP2 shards over ``dp_shard x cp`` and averages over those ranks, so inside the blocks the
gradient is scaled by ``cp`` (exactly undone where the rows leave): the average is then the sum
over cp and the mean over data ranks, as one process computes it.

The attention under ``cp`` is this module's padded torch implementation (the registered kernels
take one row set for queries and keys); it follows the kernel contract of
:class:`gem_model.components.JaggedAttentionKernel` (causal with targets, window, position and time
biases).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gem_model.api import NO_EXTRAS, gather_bias, sequence_ids, time_buckets


def head_tail_rows(offsets: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """The rows rank ``rank`` of ``cp`` holds: chunks ``rank`` and ``2cp-1-rank`` of every sequence."""
    starts, lengths = offsets[:-1], offsets[1:] - offsets[:-1]
    rows = []
    for chunk in (rank, 2 * cp - 1 - rank):
        lo = starts + lengths * chunk // (2 * cp)
        hi = starts + lengths * (chunk + 1) // (2 * cp)
        rows.append((lo, hi))
    lo = torch.stack([rows[0][0], rows[1][0]], 1).reshape(-1)  # per sequence: head chunk, then tail chunk
    hi = torch.stack([rows[0][1], rows[1][1]], 1).reshape(-1)
    counts = hi - lo
    total = int(counts.sum())
    shift = torch.repeat_interleave(lo - torch.cumsum(counts, 0) + counts, counts, output_size=total)
    return torch.arange(total, device=offsets.device) + shift


class _EnterRows(torch.autograd.Function):
    """``x[rows]``; backward: the rows' gradients of every rank put together, divided by ``cp``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, rows: torch.Tensor, group: Any, cp: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(rows)
        ctx.shape, ctx.group, ctx.cp = x.shape, group, cp
        return x[rows]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        (rows,) = ctx.saved_tensors
        full = grad.new_zeros(ctx.shape).index_copy_(0, rows, grad)
        dist.all_reduce(full, group=ctx.group)
        return full / ctx.cp, None, None, None


class _LeaveRows(torch.autograd.Function):
    """The local rows back into all ``n`` rows (one all-reduce); backward: own rows, times ``cp``."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, rows: torch.Tensor, n: int, group: Any, cp: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(rows)
        ctx.cp = cp
        full = y.new_zeros((n, *y.shape[1:])).index_copy_(0, rows, y)
        dist.all_reduce(full, group=group)
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        (rows,) = ctx.saved_tensors
        return grad[rows] * ctx.cp, None, None, None, None


# torch 2.13 renamed them (the old names warn); the GPU machine's torch 2.11 has only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """``all_gather_into_tensor`` over ``group``; backward: ``reduce_scatter_tensor`` of the gradients
    (each rank's part summed over the ranks that used it). Our own: torch.distributed.nn's all_gather
    backward on gloo scatters from group ranks as if they were global ranks, so it fails in subgroups."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
        _ALL_GATHER(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        out = grad.new_empty((grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:]))
        _REDUCE_SCATTER(out, grad.contiguous(), group=ctx.group)
        return out, None


def _gather_rows(local: torch.Tensor, rows_of: list[torch.Tensor], n: int, group: Any) -> torch.Tensor:
    """All ``n`` rows from every rank's local rows (``rows_of[r]``: rank r's row ids), differentiably."""
    most = max(int(r.numel()) for r in rows_of)
    padded = F.pad(local, (0, 0) * (local.dim() - 1) + (0, most - local.shape[0]))
    parts = _AllGather.apply(padded, group).split(most)
    ids = torch.cat(rows_of)
    values = torch.cat([p[: r.numel()] for p, r in zip(parts, rows_of, strict=True)])
    return values.new_zeros((n, *local.shape[1:])).index_copy(0, ids, values)


class ContextParallelAttention:
    """Jagged HSTU attention of this rank's query rows against all key rows of their sequences."""

    def __init__(self, kernel: Any, group: Any, *, cp: int, rank: int):
        self.kernel, self.group, self.cp, self.rank = kernel, group, cp, rank
        self.name = f"context_parallel({kernel.name})"
        self.rows_of: list[torch.Tensor] = []  # set by the block's pre-hook for each forward

    def __call__(self, q, k, v, seq_offsets, *, max_seq_len, alpha, extras=NO_EXTRAS):  # type: ignore[no-untyped-def]
        num_targets, max_attn_len = extras.num_targets, extras.max_attn_len
        position_bias, time_bias = extras.position_bias, extras.time_bias
        timestamps, query_timestamps = extras.timestamps, extras.query_timestamps
        rows, n = self.rows_of[self.rank], int(seq_offsets[-1])
        k_all = _gather_rows(k, self.rows_of, n, self.group)
        v_all = _gather_rows(v, self.rows_of, n, self.group)
        lengths = seq_offsets[1:] - seq_offsets[:-1]
        seq = sequence_ids(lengths, n)[rows]  # the sequence of each local query
        pos = rows - seq_offsets[seq]  # its position in that sequence
        width = int(lengths.max()) if lengths.numel() else 0
        j = torch.arange(width, device=q.device)
        key_rows = (seq_offsets[seq][:, None] + j[None, :]).clamp(max=max(n - 1, 0))  # [l, width]
        valid = j[None, :] < lengths[seq][:, None]
        scores = torch.einsum("ihd,ijhd->hij", q, k_all[key_rows]) * alpha
        if position_bias is not None:
            rel = (j[None, :] - pos[:, None] + max_seq_len - 1).clamp(0, 2 * max_seq_len - 2)
            scores = scores + gather_bias(position_bias, rel)
        if time_bias is not None:
            dt = query_timestamps[rows][:, None] - timestamps[key_rows]
            scores = scores + gather_bias(time_bias, time_buckets(dt, time_bias.numel()))
        t = num_targets[seq] if num_targets is not None else torch.zeros_like(seq)
        limit = (lengths[seq] - t)[:, None]
        diff = torch.minimum(pos[:, None], limit) - torch.minimum(j[None, :], limit)
        keep = diff > 0
        if max_attn_len > 0:
            keep &= diff <= max_attn_len
        keep = (keep | (j[None, :] == pos[:, None])) & valid
        w = F.silu(scores) / max_seq_len * keep.to(scores.dtype)
        return torch.einsum("hij,ijhd->ihd", w, v_all[key_rows]).to(v.dtype)


def apply_context_parallel(blocks: list[nn.Module], group: Any) -> None:
    """Split every block's rows over ``group`` (in place: the blocks' attention and two hooks each)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    for block in blocks:
        attention = ContextParallelAttention(block.attention, group, cp=cp, rank=rank)
        block.attention = attention  # offers no fused block: the block runs op by op through it

        def enter(module: nn.Module, args: tuple, attention: ContextParallelAttention = attention) -> tuple:
            x, offsets, *rest = args
            attention.rows_of = [head_tail_rows(offsets, cp, r) for r in range(cp)]
            module._cp_rows = (attention.rows_of[rank], x.shape[0])  # type: ignore[assignment]
            return (_EnterRows.apply(x, attention.rows_of[rank], group, cp), offsets, *rest)

        def leave(module: nn.Module, args: tuple, y: torch.Tensor) -> torch.Tensor:
            rows, n = module._cp_rows  # type: ignore[misc]
            return _LeaveRows.apply(y, rows, n, group, cp)

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
