"""``dq`` from stored score gradients: the third way the jagged attention backward gets ``dq``
(``dq_mode="stored"``; imports triton).

The key-major ``dk``/``dv`` pass computes ``ds`` (the gradient of the scores, masked, in the input
dtype) for every (query block, key block) pair it visits, and uses it in ``dk += ds^T q``. With a
``ds`` buffer it also stores that tile; the query-major pass then reads it back and computes
``dq = alpha / N * ds k`` with one MMA per tile pair, instead of recomputing ``s`` and ``dp`` (three
MMAs, the separate mode) or adding fp32 partial ``dq`` tiles with atomics (the atomic mode). The
stored values are the very ``ds`` the atomic mode multiplies by ``k``: the three modes differ only
in the order of the fp32 sums.

Layout. Only pairs with ``j <= i`` are ever allowed (KERNELS.md's mask), so each (sequence, head)
keeps the lower triangle of its ``[n, n]`` score matrix, row by row, each row padded to a multiple of
8 elements (16-byte aligned rows, so whole tiles load and store in vectors)::

    row i of sequence s, head h  at  H * before(s) + h * tri8(n_s) + tri8(i),   tri8(i) = sum_{r<i} ceil8(r + 1)

``before(s)`` sums ``tri8(n)`` over the sequences before ``s``; the kernels add it up while they scan
``seq_offsets`` (no host sync, no offsets tensor). Only the allowed positions are written and read.

Capacity. The buffer is sized on the host from what it knows without a sync: ``L`` rows and
``max_seq_len`` bound the sum of ``tri8(n)`` (:func:`capacity`), and a budget caps it. A sequence
whose rows would end past the capacity (one longer than ``max_seq_len``, or past the budget) is
not stored: the dk/dv pass skips its stores and the dq pass recomputes its scores for it, as the
separate mode does. So every input stays correct; only the speed depends on what fits.

Memory: ``H * (L * N / 2 + 8 L)`` elements at most, e.g. 6.6 GB for 200,000 rows of up to 4,096
with 8 heads in bf16, held from the dk/dv pass to the end of the dq pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DS_BUDGET_BYTES = 16 * 2**30
"""The most a ``ds`` buffer may take; sequences past it fall back to recomputation."""


def capacity(num_rows: int, num_heads: int, max_seq_len: int, element_size: int,
             budget_bytes: int = DS_BUDGET_BYTES) -> int:  # fmt: skip
    """Elements of a ``ds`` buffer that holds every sequence of a batch of ``num_rows`` rows whose
    sequences are at most ``max_seq_len`` long (``sum tri8(n) <= sum n (n - 1) / 2 + 8 n <= L N / 2 + 8 L``),
    capped by ``budget_bytes``."""
    bound = num_heads * (num_rows * max(max_seq_len, 1) // 2 + 8 * num_rows)
    return max(0, min(bound, budget_bytes // element_size))


def allocate(q: torch.Tensor, max_seq_len: int, budget_bytes: int = DS_BUDGET_BYTES) -> torch.Tensor:
    """An uninitialised ``ds`` buffer for the batch of ``q`` ``[L, H, D]`` (the kernels write before
    they read, and read only what they wrote)."""
    size = capacity(q.shape[0], q.shape[1], max_seq_len, q.element_size(), budget_bytes)
    return torch.empty(max(size, 1), dtype=q.dtype, device=q.device)


@triton.jit
def tri8(n):
    """Elements of rows ``0 .. n - 1`` of the packed triangle, row ``i`` padded to ``ceil8(i + 1)``:
    ``8 n + 8 sum_{r<n} floor(r / 8)`` (int64)."""
    n = n.to(tl.int64)
    a = n // 8
    return 8 * n + 32 * a * (a - 1) + 8 * a * (n - 8 * a)


@triton.jit
def chunk_sizes(SEQ_OFFSETS, chunk0, num_seqs, CHUNK: tl.constexpr):
    """``tri8(n)`` of the sequences ``chunk0 .. chunk0 + CHUNK`` (0 past the last)."""
    seqs = chunk0 + tl.arange(0, CHUNK)
    inside = seqs < num_seqs
    starts = tl.load(SEQ_OFFSETS + seqs, mask=inside, other=0)
    ends = tl.load(SEQ_OFFSETS + seqs + 1, mask=inside, other=0)
    return tri8(ends - starts)


@triton.jit
def sequence_base(sizes, tiles_end, tile, stored_before, seq_len, head, num_heads, capacity):
    """The first element of (this tile's sequence, ``head``) in the buffer, and whether the whole
    sequence fits. ``sizes``: the chunk's :func:`chunk_sizes`; ``tiles_end``: the chunk's scan (as
    given to ``locate_tile``); ``stored_before``: ``sum tri8`` of the chunks before."""
    before = stored_before + tl.sum(tl.where(tiles_end <= tile, sizes, 0))
    own = tri8(seq_len)
    fits = num_heads * (before + own) <= capacity
    return num_heads * before + head * own, fits


@triton.jit
def row_starts(base, rows):
    """Where rows ``rows`` (int32 vector, local to the sequence) start, from the (sequence, head)'s ``base``."""
    return tl.multiple_of(base + tri8(rows), 8)
