"""Jagged HSTU attention in plain torch, without padding the batch to a global maximum.

This is the default CPU kernel. Sequences are grouped into buckets of similar length; each bucket
is padded only to its own longest sequence and computed with a few batched torch ops, so the
number of python-level ops grows with the number of buckets, not with the batch size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gem_kernels.reference import attention_mask

BUCKET_GROWTH = 1.25
"""A bucket holds lengths in ``[size / BUCKET_GROWTH, size]``: at most ~1.56x the work of no padding,
and about ``log(max / min) / log(1.25)`` buckets (a dozen for lengths 16..200)."""


def plan_buckets(lengths: list[int], growth: float = BUCKET_GROWTH) -> list[tuple[int, list[int]]]:
    """Group the non-empty sequences: ``(padded size, sequence indices)`` per bucket, longest first."""
    buckets: list[tuple[int, list[int]]] = []
    for seq in sorted((b for b, n in enumerate(lengths) if n > 0), key=lambda b: -lengths[b]):
        n = lengths[seq]
        if buckets and n * growth >= buckets[-1][0]:
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
) -> torch.Tensor:
    """Same result as :func:`gem_kernels.reference.jagged_attention_reference`, bucketed by length.

    Differentiable through autograd. Reads ``seq_offsets`` on the host (a sync on GPU inputs).
    """
    num_rows, num_heads = q.shape[:2]
    dim_v = v.shape[-1]
    offsets = seq_offsets.tolist()
    lengths = [offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1)]
    targets = num_targets.tolist() if num_targets is not None else [0] * len(lengths)
    device = q.device
    parts: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    for size, seqs in plan_buckets(lengths):
        starts = torch.tensor([offsets[b] for b in seqs], device=device)
        seq_lens = torch.tensor([lengths[b] for b in seqs], device=device)
        seq_targets = torch.tensor([targets[b] for b in seqs], device=device)
        positions = torch.arange(size, device=device)
        # Padding slots re-read the sequence's last row: finite values that the mask zeroes, so
        # no zero row has to be appended to (copies of) q, k and v.
        gather = starts[:, None] + torch.minimum(positions[None, :], seq_lens[:, None] - 1)
        inside = (positions[None, :] < seq_lens[:, None]).flatten()
        nb = len(seqs)

        def bucket(x: torch.Tensor, gather: torch.Tensor = gather, nb: int = nb, size: int = size) -> torch.Tensor:
            return x.index_select(0, gather.flatten()).view(nb, size, num_heads, -1).transpose(1, 2)

        scale = attention_mask(seq_lens, seq_targets, max_attn_len, size).to(v.dtype) / max_seq_len
        weights = F.silu(alpha * (bucket(q) @ bucket(k).transpose(-1, -2))) * scale[:, None]
        out = (weights @ bucket(v)).transpose(1, 2).reshape(nb * size, num_heads, dim_v)
        keep = inside.nonzero().squeeze(1)
        parts.append(out.index_select(0, keep))
        rows.append(gather.flatten().index_select(0, keep))
    if not parts:  # no rows at all: an empty result that still belongs to the autograd graph
        return v * 0.0
    return v.new_zeros((num_rows, num_heads, dim_v)).index_copy(0, torch.cat(rows), torch.cat(parts))
