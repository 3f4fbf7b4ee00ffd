"""Jagged HSTU attention in plain torch, without padding the batch to a global maximum.

This is the default CPU kernel. Sequences are grouped into buckets of similar length; each bucket
is padded only to its own longest sequence and computed with a few batched torch ops, so the
number of python-level ops grows with the number of buckets, not with the batch size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gem_kernels.reference import attention_mask
from gem_model.jagged import relative_bias_matrix, time_bias_matrix

BUCKET_GROWTH = 1.25
"""A bucket holds lengths in ``[size / BUCKET_GROWTH, size]``: at most ~1.56x the work of no padding,
and about ``log(max / min) / log(1.25)`` buckets (half a dozen for lengths 40..200)."""
SMALL_BUCKET = 64
"""Sequences this short share one bucket: padding them costs less than the ~20 ops of another bucket."""


def plan_buckets(lengths: list[int], growth: float = BUCKET_GROWTH) -> list[tuple[int, list[int]]]:
    """Group the non-empty sequences: ``(padded size, sequence indices)`` per bucket, longest first."""
    buckets: list[tuple[int, list[int]]] = []
    for seq in sorted((b for b, n in enumerate(lengths) if n > 0), key=lambda b: -lengths[b]):
        n = lengths[seq]
        if buckets and (n * growth >= buckets[-1][0] or buckets[-1][0] <= SMALL_BUCKET):
            buckets[-1][1].append(seq)
        else:
            buckets.append((n, [seq]))
    return buckets


def jagged_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    *,
    max_seq_len: int,
    alpha: float,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    position_bias: torch.Tensor | None = None,
    time_bias: torch.Tensor | None = None,
    timestamps: torch.Tensor | None = None,
    query_timestamps: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same result as :func:`gem_kernels.reference.jagged_attention_reference`, bucketed by length.

    Differentiable through autograd. Reads ``seq_offsets`` on the host (a sync on GPU inputs).
    """
    num_rows, num_heads = q.shape[:2]
    device = q.device
    # 16-bit inputs are computed in float32: CPUs without bf16 matmul units are no slower for it,
    # and the n x n weights are not rounded to 8 bits of mantissa.
    compute = torch.promote_types(v.dtype, torch.float32)
    offsets = seq_offsets.tolist()
    lengths = [offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1)]
    buckets = plan_buckets(lengths)
    if not buckets:  # no rows at all: an empty result that still belongs to the autograd graph
        return v * 0.0
    # Every bucket is a [sequences, size] block of slots in one flat padded buffer; row r of
    # sequence b goes to slot first_slot[b] + (r - offsets[b]).
    first_slot = [0] * len(lengths)
    bucket_slots = []
    used = 0
    for size, seqs in buckets:
        for i, seq in enumerate(seqs):
            first_slot[seq] = used + i * size
        bucket_slots.append(used)
        used += size * len(seqs)
    lengths_t = torch.tensor(lengths, device=device)
    seq_of_row = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t, output_size=num_rows)
    shift = torch.tensor(first_slot, device=device) - seq_offsets.to(device=device, dtype=torch.int64)[:-1]
    slot_of_row = torch.arange(num_rows, device=device) + shift[seq_of_row]

    def pad(x: torch.Tensor) -> torch.Tensor:
        # index_put into zeros: its backward is a gather (index_select's would be a slow scatter_add on CPU).
        return x.new_zeros((used, num_heads, x.shape[-1]), dtype=compute).index_put((slot_of_row,), x.to(compute))

    padded_q, padded_k, padded_v = pad(q), pad(k), pad(v)
    if time_bias is not None:
        assert timestamps is not None and query_timestamps is not None
        padded_times = [
            t.new_zeros(used).index_put((slot_of_row,), t.to(device)) for t in (query_timestamps, timestamps)
        ]
    targets = num_targets.to(device) if num_targets is not None else torch.zeros_like(lengths_t)
    outs = []
    for (size, seqs), slot in zip(buckets, bucket_slots, strict=True):
        nb = len(seqs)
        chosen = torch.tensor(seqs, device=device)

        def bucket(x: torch.Tensor, slot: int = slot, nb: int = nb, size: int = size) -> torch.Tensor:
            return x[slot : slot + nb * size].view(nb, size, num_heads, -1).transpose(1, 2)

        scale = attention_mask(lengths_t[chosen], targets[chosen], max_attn_len, size).to(compute) / max_seq_len
        scores = alpha * (bucket(padded_q) @ bucket(padded_k).transpose(-1, -2))
        if position_bias is not None:
            scores = scores + relative_bias_matrix(position_bias.to(compute), size, max_seq_len)
        if time_bias is not None:
            qt, kt = (t[slot : slot + nb * size].view(nb, size) for t in padded_times)
            scores = scores + time_bias_matrix(time_bias.to(compute), qt, kt)[:, None]
        weights = F.silu(scores) * scale[:, None]
        outs.append((weights @ bucket(padded_v)).transpose(1, 2).reshape(nb * size, num_heads, -1))
    return torch.cat(outs)[slot_of_row].to(v.dtype)
