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
keeps, key by key, the queries that may see that key: key row ``j`` holds queries ``floor8(j) ..
ceil8(n) - 1`` (its width a multiple of 8, so rows stay 16-byte aligned)::

    (j, i) of sequence s, head h  at  H * before(s) + h * size(n_s) + key_row(j) + i
    key_row(j) = sum_{r<j} (ceil8(n) - floor8(r)) - floor8(j),   size(n) = sum_{r<n} (ceil8(n) - floor8(r))

Key rows, because the dk/dv pass holds ``ds`` as ``[keys, queries]`` with the queries along each
thread's registers: its stores then run along the queries, contiguous in memory (a layout with the
keys contiguous made them scattered 2-byte stores: the pass took 1.49x its time without stores on the
H200). The dq pass reads ``[queries, keys]`` tiles of it transposed, through shared memory as any
MMA operand. ``before(s)`` sums ``size(n)`` over the sequences before ``s``; the kernels add it up
while they scan ``seq_offsets`` (no host sync, no offsets tensor). Only the allowed positions are
written; the dq pass reads them, and on unmasked tiles also padding rows (queries past the sequence,
whose results are never stored), which the buffer's slack keeps inside the allocation.

Capacity. The buffer is sized on the host from what it knows without a sync: ``L`` rows and
``max_seq_len`` bound the sum of ``size(n)`` (:func:`capacity`), and a budget caps it. A sequence
whose rows would end past the capacity (one longer than ``max_seq_len``, or past the budget) is
not stored: the dk/dv pass skips its stores and the dq pass recomputes its scores for it, as the
separate mode does. So every input stays correct; only the speed depends on what fits.

Memory: ``H * (L * N / 2 + 15 L)`` elements at most, e.g. 6.6 GB for 200,000 rows of up to 4,096
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
    sequences are at most ``max_seq_len`` long, capped by ``budget_bytes``: a key row is at most
    ``n - j + 14`` wide, so ``size(n) <= n (n + 1) / 2 + 14 n`` and the sum is at most ``L N / 2 + 15 L``."""
    bound = num_heads * (num_rows * max(max_seq_len, 1) // 2 + 15 * num_rows)
    return max(0, min(bound, budget_bytes // element_size))


SLACK = 256
"""Elements past the capacity that unmasked tiles of the dq pass may read (padding rows of a query
block: at most ``BLOCK_M`` past the last key row's end)."""


def allocate(q: torch.Tensor, max_seq_len: int, budget_bytes: int = DS_BUDGET_BYTES) -> torch.Tensor:
    """An uninitialised ``ds`` buffer for the batch of ``q`` ``[L, H, D]`` (the kernels write before
    they read; what they read unwritten lands only in rows they never store): ``capacity`` elements,
    a view of an allocation with :data:`SLACK` more."""
    size = capacity(q.shape[0], q.shape[1], max_seq_len, q.element_size(), budget_bytes)
    return torch.empty(size + SLACK, dtype=q.dtype, device=q.device)[: max(size, 1)]


def check_buffer(ds: torch.Tensor, dtype: torch.dtype, where: str) -> None:
    """A ``ds`` buffer is 1-d, of the inputs' dtype, and has :data:`SLACK` elements of storage past its end."""
    spare = ds.untyped_storage().nbytes() // ds.element_size() - ds.storage_offset() - ds.numel()
    if ds.dim() != 1 or ds.dtype != dtype or not ds.is_contiguous() or spare < SLACK:
        raise ValueError(
            f"{where}: ds must be a contiguous 1-d {dtype} buffer with {SLACK} elements of storage past its end "
            f"(gem_kernels.attention_triton_stored.allocate); got {ds.dtype} {tuple(ds.shape)} with {spare} spare"
        )


@triton.jit
def _rows_before(j, c):
    """``sum_{r<j} (c - floor8(r))`` (int64), ``c = ceil8(n)``: where key row ``j`` starts."""
    a = j // 8
    return 8 * a * c - 32 * a * (a - 1) + (j - 8 * a) * (c - 8 * a)


@triton.jit
def packed_size(n):
    """Elements of one (sequence, head) of length ``n``: its ``n`` key rows (int64)."""
    n = n.to(tl.int64)
    return _rows_before(n, (n + 7) // 8 * 8)


@triton.jit
def key_rows(base, keys, seq_len):
    """Where (key ``j``, query 0) would sit, for the keys ``keys`` (int32 vector, local to the
    sequence) of the (sequence, head) at ``base``: add a query index to reach its element."""
    j = keys.to(tl.int64)
    c = (seq_len.to(tl.int64) + 7) // 8 * 8
    return tl.multiple_of(base + _rows_before(j, c) - j // 8 * 8, 8)


@triton.jit
def chunk_sizes(SEQ_OFFSETS, chunk0, num_seqs, CHUNK: tl.constexpr):
    """:func:`packed_size` of the sequences ``chunk0 .. chunk0 + CHUNK`` (0 past the last)."""
    seqs = chunk0 + tl.arange(0, CHUNK)
    inside = seqs < num_seqs
    starts = tl.load(SEQ_OFFSETS + seqs, mask=inside, other=0)
    ends = tl.load(SEQ_OFFSETS + seqs + 1, mask=inside, other=0)
    return packed_size(ends - starts)


@triton.jit
def sequence_base(sizes, tiles_end, tile, stored_before, seq_len, head, num_heads, capacity):
    """The first element of (this tile's sequence, ``head``) in the buffer, and whether the whole
    sequence fits. ``sizes``: the chunk's :func:`chunk_sizes`; ``tiles_end``: the chunk's scan (as
    given to ``locate_tile``); ``stored_before``: the sizes of the chunks before, summed."""
    before = stored_before + tl.sum(tl.where(tiles_end <= tile, sizes, 0))
    own = packed_size(seq_len)
    fits = num_heads * (before + own) <= capacity
    return num_heads * before + head * own, fits
