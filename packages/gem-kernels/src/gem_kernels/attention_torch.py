"""Jagged HSTU attention in plain torch, without padding the batch to a global maximum.

This is the default CPU kernel. Sequences are grouped into buckets of similar length; each bucket
is padded only to its own longest sequence and computed with a few batched torch ops, so the
number of python-level ops grows with the number of buckets, not with the batch size.

The bucketing (a host sync on GPU inputs, then python) and the mask of each bucket depend only on
``seq_offsets``, ``num_targets`` and the window, which every block of a model shares within a step;
:class:`LayoutCache` keeps the last layout (and the time-bucket indices of the time bias), so the
blocks after the first reuse them.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gem_kernels.reference import attention_mask
from gem_model.api import NO_EXTRAS, AttentionExtras, gather_bias, relative_bias_matrix, time_bucket_matrix

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


@dataclass
class Layout:
    """Where each row goes in one flat padded buffer, and each bucket's block of it.

    Bucket ``k`` is the ``[count, size]`` block of slots starting at ``starts[k]``; row ``r`` of
    sequence ``b`` goes to slot ``first_slot[b] + (r - offsets[b])``. ``masks[k]``: bool
    ``[count, size, size]``, which (query, key) pairs of the bucket attend.
    """

    used: int
    slot_of_row: torch.Tensor
    sizes: list[int]
    counts: list[int]
    starts: list[int]
    masks: list[torch.Tensor]

    def view(self, x: torch.Tensor, k: int) -> torch.Tensor:
        """Bucket ``k`` of a padded ``[used, ...]`` buffer as ``[count, size, ...]``."""
        s, c, n = self.starts[k], self.counts[k], self.sizes[k]
        return x[s : s + c * n].view(c, n, *x.shape[1:])


def plan_layout(seq_offsets: torch.Tensor, num_targets: torch.Tensor | None, max_attn_len: int, device: torch.device) -> Layout:
    offsets = seq_offsets.tolist()
    lengths = [offsets[b + 1] - offsets[b] for b in range(len(offsets) - 1)]
    buckets = plan_buckets(lengths)
    first_slot = [0] * len(lengths)
    starts, used = [], 0
    for size, seqs in buckets:
        for i, seq in enumerate(seqs):
            first_slot[seq] = used + i * size
        starts.append(used)
        used += size * len(seqs)
    lengths_t = torch.tensor(lengths, device=device)
    num_rows = offsets[-1] - offsets[0]
    seq_of_row = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths_t, output_size=num_rows)
    shift = torch.tensor(first_slot, device=device) - seq_offsets.to(device=device, dtype=torch.int64)[:-1]
    targets = num_targets.to(device) if num_targets is not None else torch.zeros_like(lengths_t)
    masks = []
    for size, seqs in buckets:
        chosen = torch.tensor(seqs, device=device)
        masks.append(attention_mask(lengths_t[chosen], targets[chosen], max_attn_len, size))
    return Layout(
        used=used,
        slot_of_row=torch.arange(num_rows, device=device) + shift[seq_of_row],
        sizes=[size for size, _ in buckets],
        counts=[len(seqs) for _, seqs in buckets],
        starts=starts,
        masks=masks,
    )


class LayoutCache:
    """The layout of the last call, reused while its inputs are the same tensor objects, unmodified.

    Entries are keyed by the inputs' ``id`` and version counter and hold weak references to them:
    an entry counts only while those tensors are alive (so a new tensor that happens to get a freed
    one's ``id`` never hits), and an in-place change bumps the version and misses.
    """

    def __init__(self) -> None:
        self._layout: tuple[tuple, tuple, Layout] | None = None
        self._times: tuple[tuple, tuple, list[torch.Tensor]] | None = None

    @staticmethod
    def _hit(entry: tuple | None, key: tuple) -> bool:
        return entry is not None and entry[0] == key and all(ref() is not None for ref in entry[1])

    @staticmethod
    def _key(tensors: tuple[torch.Tensor | None, ...], extra: tuple) -> tuple[tuple, tuple]:
        key = tuple((id(t), t._version) if t is not None else None for t in tensors) + extra
        return key, tuple(weakref.ref(t) for t in tensors if t is not None)

    def layout(self, seq_offsets: torch.Tensor, num_targets: torch.Tensor | None, max_attn_len: int,
               device: torch.device) -> Layout:
        key, refs = self._key((seq_offsets, num_targets), (max_attn_len, str(device)))
        if not self._hit(self._layout, key):
            self._layout = (key, refs, plan_layout(seq_offsets, num_targets, max_attn_len, device))
            self._times = None
        assert self._layout is not None
        return self._layout[2]

    def time_index(self, layout: Layout, timestamps: torch.Tensor, query_timestamps: torch.Tensor,
                   num_buckets: int) -> list[torch.Tensor]:
        """Per bucket of ``layout``, the ``[count, size, size]`` time-bucket ids of query time - key time."""
        key, refs = self._key((timestamps, query_timestamps), (id(layout), num_buckets))
        if not self._hit(self._times, key):
            self._times = (key, refs, time_index(layout, timestamps, query_timestamps, num_buckets))
        assert self._times is not None
        return self._times[2]


def time_index(layout: Layout, timestamps: torch.Tensor, query_timestamps: torch.Tensor, num_buckets: int) -> list[torch.Tensor]:
    """Per bucket of ``layout``, ``[count, size, size]`` :func:`~gem_model.jagged.time_bucket_matrix` of query and key times."""
    device = layout.slot_of_row.device
    padded = [t.new_zeros(layout.used).index_put((layout.slot_of_row,), t.to(device)) for t in (query_timestamps, timestamps)]
    return [time_bucket_matrix(layout.view(padded[0], k), layout.view(padded[1], k), num_buckets)
            for k in range(len(layout.sizes))]


def jagged_attention_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    *,
    max_seq_len: int,
    alpha: float,
    extras: AttentionExtras = NO_EXTRAS,
    cache: LayoutCache | None = None,
) -> torch.Tensor:
    """Same result as :func:`gem_kernels.reference.jagged_attention_reference`, bucketed by length.

    Differentiable through autograd. Reads ``seq_offsets`` on the host (a sync on GPU inputs),
    unless ``cache`` holds the layout of the same ``seq_offsets`` already.
    """
    num_targets, max_attn_len = extras.num_targets, extras.max_attn_len
    position_bias, time_bias = extras.position_bias, extras.time_bias
    timestamps, query_timestamps = extras.timestamps, extras.query_timestamps
    num_heads = q.shape[1]
    device = q.device
    # 16-bit inputs are computed in float32: CPUs without bf16 matmul units are no slower for it,
    # and the n x n weights are not rounded to 8 bits of mantissa.
    compute = torch.promote_types(v.dtype, torch.float32)
    cache = cache if cache is not None else LayoutCache()
    layout = cache.layout(seq_offsets, num_targets, max_attn_len, device)
    if not layout.sizes:  # no rows at all: an empty result that still belongs to the autograd graph
        return v * 0.0
    times = None
    if time_bias is not None:
        assert timestamps is not None and query_timestamps is not None
        times = cache.time_index(layout, timestamps, query_timestamps, time_bias.numel())

    def pad(x: torch.Tensor) -> torch.Tensor:
        # index_put into zeros: its backward is a gather (index_select's would be a slow scatter_add on CPU).
        return x.new_zeros((layout.used, num_heads, x.shape[-1]), dtype=compute).index_put((layout.slot_of_row,), x.to(compute))

    padded_q, padded_k, padded_v = pad(q), pad(k), pad(v)
    outs = []
    for b, size in enumerate(layout.sizes):

        def bucket(x: torch.Tensor, b: int = b) -> torch.Tensor:
            return layout.view(x, b).transpose(1, 2)  # [count, heads, size, dim]

        scores = alpha * (bucket(padded_q) @ bucket(padded_k).transpose(-1, -2))
        if position_bias is not None:
            scores = scores + relative_bias_matrix(position_bias.to(compute), size, max_seq_len)
        if time_bias is not None and times is not None:
            scores = scores + gather_bias(time_bias.to(compute), times[b])[:, None]
        weights = F.silu(scores) * (layout.masks[b].to(compute) / max_seq_len)[:, None]
        outs.append((weights @ bucket(padded_v)).transpose(1, 2).reshape(layout.counts[b] * size, num_heads, -1))
    return torch.cat(outs)[layout.slot_of_row].to(v.dtype)
