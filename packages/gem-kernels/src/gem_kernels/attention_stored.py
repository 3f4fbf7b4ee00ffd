"""``dq`` from the score gradients that the ``dk``/``dv`` pass stores: ``dq_mode="stored"`` (imports triton).

The backward needs ``ds = dP * silu'(s)`` of every allowed (query, key) pair twice: ``dk += ds^T q`` in the
key-major pass and ``dq += ds k``. The ``separate`` mode recomputes ``s`` and ``dP`` in a query-major pass
(three MMAs a pair, with the silu again). Here the key-major pass also writes each ``ds`` tile it makes, in
the input dtype, and :func:`dq_from_stored` reads them back: one MMA a pair and 2 bytes of memory traffic
each way. The values are the ``ds`` that the other modes multiply by ``k`` (cast to the input dtype, as the
``dq`` pass casts its own): the modes differ in the order of the float32 sums alone.

Why again. Tried on 2026-12-03 with the Triton key-major kernel as the writer, it was slower: that kernel sits
at 255 registers, and the stores added spills and did not hide behind its MMAs
(``benchmarks/results/jagged_attention.md``). The Gluon ``dk``/``dv`` pass (:mod:`gem_kernels.attention_gluon_dkdv`)
writes a tile through shared memory and one bulk tensor store, issued asynchronously, with no address
registers. And on a power-capped step what counts is energy: the ``dq`` pass was ~14 % of the step's
(``benchmarks/results/e2e_ab.md``, 2026-12-06).

Layout. Tiles of ``32`` queries x ``64`` keys, row-major (keys contiguous), one per (query block ``i``, key
block ``j``) with ``i >= 2 j`` (the others hold no allowed pair), grouped by sequence, then head, then key
block (the order the ``dk``/``dv`` pass makes them in)::

    tile(s, h, j, i) = base[s] + h c(n) + j Qb - j (j - 1) + i - 2 j
    c(n) = Kb Qb - Kb (Kb - 1),   Kb = ceil(n / 64),   Qb = ceil(n / 32)

``base[s]`` is the number of tiles of the sequences before ``s`` (all heads of the buffer). The ``dq`` pass takes 64 queries
at a time: tiles ``(2p, j)`` and ``(2p + 1, j)`` are neighbours, one ``[64, 64]`` block. A writer may leave
pairs unwritten that the mask forbids (past a sequence's end, or target keys' rows): :func:`dq_from_stored`
masks every block that can hold one, by selection, so what was never written is never added.

Size. ``H sum c(n)`` tiles of 4 KiB in bf16: ~2 bytes a pair plus the diagonal's padding, e.g. ~3.6 GB for
one block of the big config, held from the ``dk``/``dv`` pass to the end of this pass. Counting them needs the
lengths on the host: :func:`prepare` starts that count on the device in the forward and copies it to the host
without waiting; the backward reads it long after it landed.

Why bf16. Tiles in e4m3 with a float32 scale per key of each tile (1.125 bytes a pair instead of 2) were built
and measured on 2026-12-07 (commit f85073e): on the H100 at its power cap, one block of the big config, the
whole backward took 7.355 ms and 5.14 J against 6.427 ms and 4.47 J, the storing ``dk``/``dv`` pass 3.75 J
against 3.26 and the ``dq`` pass 1.39 J against 1.20 (``benchmarks/kernel_energy.py``;
``benchmarks/results/jagged_attention.md``). Half the bytes did not pay for the work around them: each key's
amax, the scaling and conversion, 16 byte stores a thread a step into the transposed shared tile (bf16 takes
4 ``stmatrix``), and in the ``dq`` pass the widening back to bf16 through registers and shared memory
before the MMA. They were removed.

Head groups. A buffer holds the tiles of ``g`` heads, the most of a divisor of ``H`` that fit
:data:`BUDGET_BYTES`; the backward runs both passes on each group of ``g`` heads in turn (head slices of the
``[L, H, D]`` tensors) and reuses the buffer. So long sequences (at ``N = 4096``, B 512, H 4: 32.5 GiB of tiles
for all heads) still take their ``dq`` from stored tiles. A batch of which not even one head fits recomputes
(``separate``) instead.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_bias import RelativeBias
from gem_kernels.attention_triton_common import (
    CHUNK,
    INTERPRET,
    allowed,
    cast,
    device_guard,
    dot,
    history_length,
    locate_tile,
    num_programs,
    queue_counter,
    release_queue,
    scan_chunk,
    tma_loads,
)

TILE_Q, TILE_K = 32, 64
"""Queries and keys of a stored tile (the Gluon ``dk``/``dv`` pass's ``n64m32`` step)."""
BUDGET_BYTES = 12 * 2**30
"""The most a ``ds`` buffer may take: a batch that needs more stores a group of heads at a time, and one of which
not even one head fits recomputes its scores (``separate``)."""
HEAD_DIMS = (64, 128)
"""Head dims of the ``dq`` pass here (its key tile is ``[64, D]``)."""
LAUNCH = (4, 4, 2)
"""(warps, pipeline stages, programs an SM) of the ``dq`` pass: one warpgroup's ``[64, D]`` float32
accumulator, two programs an SM. On the H100 (2026-12-06, ``benchmarks/stored_dq.py --rounds 5``, big config)
1.753 ms against 1.870 at 3 stages, 2.343 at (4, 2, 3), 2.572 on 8 warps. A 128-query form (four tiles of a
key block a program, 57c4d43) was slower at every launch it was timed at (H100, 2026-12-06): 2.297 ms at best
(8 warps, 3 stages, one program an SM) against 1.739 here; removed."""


@triton.jit
def tiles_of(n):
    """``c(n)``: the stored tiles of one (sequence, head) of length ``n`` (int64)."""
    n = n.to(tl.int64)
    kb = (n + 63) // 64
    qb = (n + 31) // 32
    return kb * qb - kb * (kb - 1)


@triton.jit
def tile_index(head_base, j, i, n):
    """The tile of (query block ``i`` of 32, key block ``j`` of 64) in a (sequence, head) of length ``n`` whose
    first tile is ``head_base``."""
    qb = (n.to(tl.int64) + 31) // 32
    return head_base + j * qb - j * (j - 1) + i - 2 * j  # int64 through head_base and qb


@triton.jit
def head_base(DS_BASE, seq, head, n):
    """The first tile of (``seq``, ``head``)."""
    return tl.load(DS_BASE + seq).to(tl.int64) + head * tiles_of(n)


@triton.jit
def store_tile_elements(DS, base, ds_t, keys, queries, n):
    """Store a ``[keys, queries]`` tile of ``ds`` (sequence-local indices, already cast) element by element into
    the layout: every pair whose stored tile exists (for writers whose blocks are not the layout's tiles)."""
    k2 = keys[:, None]
    q2 = queries[None, :]
    j = k2 // 64
    i = q2 // 32
    exists = (i >= 2 * j) & (q2 < (n + 31) // 32 * 32) & (k2 < (n + 63) // 64 * 64)
    offset = tile_index(base, j, i, n) * (32 * 64) + (q2 % 32) * 64 + k2 % 64
    tl.store(DS + offset, ds_t, mask=exists)


@triton.jit
def _load_pair(DS, ds_desc, k_head, k_desc, rows, keys, k_row, k_col, offs_m, offs_n, offs_d, stride_km, keys_ok,
               TMA: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """A ``[64, 64]`` block of stored ``ds`` from row ``rows`` (int64) on, and the ``[64, D]`` key tile of keys
    ``keys`` (``k_row``, ``k_col``: its first row and column in the whole ``[L, H D]`` tensor). By descriptors,
    rows past the sequence hold the next one's keys (past the tensor, zeros): a masked step's selection
    drops them."""
    if TMA:
        return ds_desc.load([rows.to(tl.int32), 0]), k_desc.load([k_row, k_col])
    ds = tl.load(DS + (rows + offs_m)[:, None] * 64 + offs_n[None, :])
    if MASKED:
        return ds, tl.load(k_head + keys[:, None] * stride_km + offs_d[None, :], mask=keys_ok[:, None], other=0.0)
    return ds, tl.load(k_head + keys[:, None] * stride_km + offs_d[None, :])


@triton.jit(do_not_specialize=["num_seqs", "num_heads", "num_rows", "ds_rows"])
def _dq_stored_kernel(DS, DS_BASE, K, DQ, SEQ_OFFSETS, NUM_TARGETS, COUNTER, stride_km, stride_kh, stride_dqm,
                      stride_dqh, num_seqs, num_heads, num_rows, ds_rows, scale, DQK: tl.constexpr,
                      HAS_TARGETS: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr, CHUNK: tl.constexpr,
                      TMA: tl.constexpr):  # fmt: skip
    """``dq = scale * ds k`` for every (sequence, head, block of 64 queries), the sequence's last block first;
    ``TMA``: the ``ds`` blocks and key tiles by tensor descriptors (``DS`` ``[ds_rows, 64]``, ``K`` ``[num_rows,
    num_heads * DQK]``)."""
    offs_m = tl.arange(0, 64)
    offs_n = tl.arange(0, 64)
    offs_d = tl.arange(0, DQK)
    ds_desc = DS  # unused without TMA
    k_desc = K
    if TMA:
        ds_desc = tl.make_tensor_descriptor(DS, shape=[ds_rows, 64], strides=[64, 1], block_shape=[64, 64])
        k_desc = tl.make_tensor_descriptor(K, shape=[num_rows, num_heads * DQK], strides=[stride_km, 1],
                                           block_shape=[64, DQK])  # fmt: skip
    tile = tl.atomic_add(COUNTER, 1, sem="relaxed")
    tiles_before = tile * 0
    for chunk0 in range(0, num_seqs, CHUNK):
        tiles, tiles_end = scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before, 64, CHUNK)
        chunk_end = tiles_before + tl.sum(tiles)
        while tile < chunk_end:
            seq, seq_start, seq_len, head, block, blocks = locate_tile(
                tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, 64
            )
            next_tile = tl.atomic_add(COUNTER, 1, sem="relaxed")
            p = blocks - 1 - block
            history_len = history_length(NUM_TARGETS, seq, seq_len, HAS_TARGETS)
            base = head_base(DS_BASE, seq, head, seq_len)
            queries = p * 64 + offs_m
            k_head = K + seq_start * stride_km + head * stride_kh
            acc = tl.zeros([64, DQK], dtype=tl.float32)
            # key blocks wholly in the history and before the queries: every pair allowed, every pair written
            full_end = tl.minimum(p, history_len // 64)
            k_col = head * DQK
            for j in range(0, full_end):
                keys = j * 64 + offs_n
                rows = tile_index(base, j, 2 * p, seq_len) * 32
                ds, k = _load_pair(DS, ds_desc, k_head, k_desc, rows, keys, (seq_start + j * 64).to(tl.int32), k_col,
                                   offs_m, offs_n, offs_d, stride_km, keys, TMA, False)  # fmt: skip
                acc = dot(ds, k, acc, IEEE, INTERP)
            for j in range(full_end, p + 1):
                keys = j * 64 + offs_n
                keys_ok = keys < seq_len
                rows = tile_index(base, j, 2 * p, seq_len) * 32
                ds, k = _load_pair(DS, ds_desc, k_head, k_desc, rows, keys, (seq_start + j * 64).to(tl.int32), k_col,
                                   offs_m, offs_n, offs_d, stride_km, keys_ok, TMA, True)  # fmt: skip
                keep = allowed(queries[:, None], keys[None, :], history_len, 0, False) & keys_ok[None, :]
                ds = tl.where(keep, ds, 0.0)  # a selection: what was never written is never added
                acc = dot(ds, k, acc, IEEE, INTERP)
            dq_ptrs = DQ + seq_start * stride_dqm + head * stride_dqh + queries[:, None] * stride_dqm + offs_d[None, :]
            tl.store(dq_ptrs, cast(acc * scale, DQ.dtype.element_ty, INTERP), mask=(queries < seq_len)[:, None])
            tile = next_tile
        tiles_before = chunk_end
    release_queue(COUNTER)


@dataclass
class StoredScores:
    """Where the ``dk``/``dv`` pass writes its ``ds`` tiles: ``buffer [tiles * 32 + 32, 64]`` (one spare tile: the
    ``dq`` pass reads whole ``[64, 64]`` blocks, whose second half may lie past the last tile), ``base [B]``
    (int64, each sequence's first tile) and ``heads``, how many heads' tiles the buffer holds (the passes take
    that many heads at a time; ``None``: every head of the call)."""

    buffer: torch.Tensor
    base: torch.Tensor
    heads: int | None = None


class ScorePlan:
    """The tile count of a batch, started on the device by :func:`prepare` and read by :meth:`scores`."""

    def __init__(self, seq_offsets: torch.Tensor, num_heads: int) -> None:
        lengths = (seq_offsets[1:] - seq_offsets[:-1]).to(torch.int64)
        kb = (lengths + 63) // 64
        qb = (lengths + 31) // 32
        counts = kb * qb - kb * (kb - 1)
        ends = torch.cumsum(counts, 0)
        self._head_base = ends - counts  # a sequence's first tile in a buffer of one head
        self.num_heads = num_heads
        self._bases: dict[int, torch.Tensor] = {}
        per_head = ends[-1:] if ends.numel() else torch.zeros(1, dtype=torch.int64, device=seq_offsets.device)
        self._event: torch.cuda.Event | None = None
        if per_head.is_cuda:
            self._per_head = torch.empty(1, dtype=torch.int64, pin_memory=True)
            self._per_head.copy_(per_head, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._per_head = per_head

    def base_for(self, heads: int) -> torch.Tensor:
        """Each sequence's first tile in a buffer of ``heads`` heads."""
        if heads not in self._bases:
            self._bases[heads] = self._head_base * heads
        return self._bases[heads]

    def tiles_per_head(self) -> int:
        if self._event is not None:
            self._event.synchronize()  # recorded in the forward: long done by the backward
        return int(self._per_head[0])

    def tiles(self, heads: int | None = None) -> int:
        """The tiles of ``heads`` heads (every head)."""
        return self.tiles_per_head() * (self.num_heads if heads is None else heads)

    def buffer_bytes(self, dtype: torch.dtype, heads: int | None = None) -> int:
        """What a ``ds`` buffer of ``heads`` heads (every head) of this batch takes in ``dtype``: its tiles and the
        spare one."""
        return (self.tiles(heads) + 1) * TILE_Q * TILE_K * dtype.itemsize

    def group_heads(self, dtype: torch.dtype, budget_bytes: int | None = None) -> int:
        """The most heads, a divisor of the head count, whose buffer fits ``budget_bytes`` (:data:`BUDGET_BYTES`);
        0 if not even one head's does."""
        budget = BUDGET_BYTES if budget_bytes is None else budget_bytes
        divisors = [g for g in range(1, self.num_heads + 1) if self.num_heads % g == 0]
        return max((g for g in divisors if self.buffer_bytes(dtype, g) <= budget), default=0)

    def scores(self, dtype: torch.dtype, budget_bytes: int | None = None) -> StoredScores | None:
        """A buffer for the tiles of :meth:`group_heads` heads, or None if not even one head's fits ``budget_bytes``
        (:data:`BUDGET_BYTES`) or the device has no room for it (the caller then recomputes)."""
        heads = self.group_heads(dtype, budget_bytes)
        if heads == 0:
            return None
        try:
            buffer = torch.empty(((self.tiles(heads) + 1) * TILE_Q, TILE_K), dtype=dtype, device=self._head_base.device)
        except torch.OutOfMemoryError:  # the step goes on, recomputing; it only runs slower
            return None
        return StoredScores(buffer, self.base_for(heads), heads)


_LAST: list[tuple[weakref.ref[torch.Tensor], int, int, ScorePlan]] = []


def prepare(seq_offsets: torch.Tensor, num_heads: int) -> ScorePlan:
    """The :class:`ScorePlan` of a batch (the blocks of a step share one: it is kept for the same
    ``seq_offsets`` tensor, unchanged, and head count)."""
    if _LAST:
        ref, version, heads, plan = _LAST[0]
        if ref() is seq_offsets and version == seq_offsets._version and heads == num_heads:
            return plan
    plan = ScorePlan(seq_offsets, num_heads)
    _LAST[:] = [(weakref.ref(seq_offsets), seq_offsets._version, num_heads, plan)]
    return plan


def applies(q: torch.Tensor, k: torch.Tensor, bias: RelativeBias, max_attn_len: int) -> bool:
    """Whether a call on these ``[L, H, D]`` tensors can take its ``dq`` from stored tiles: a head dim in
    :data:`HEAD_DIMS`, no relative bias and no window (the key-major pass's stores do not cover them); other
    calls recompute (``separate``). float32 inputs store float32 tiles (only the Triton passes take them)."""
    return (q.shape[2] == k.shape[2] and q.shape[2] in HEAD_DIMS
            and bias.position is None and bias.time is None and max_attn_len <= 0)  # fmt: skip


def dq_from_stored(scores: StoredScores, k: torch.Tensor, seq_offsets: torch.Tensor, num_targets: torch.Tensor | None,
                   *, max_seq_len: int, alpha: float, out: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """``out[:] = alpha / max_seq_len * ds k`` (``out``, ``k``: ``[L, H, D]`` with unit last stride) from the tiles
    the ``dk``/``dv`` pass stored in ``scores``."""
    rows, heads, dim = k.shape
    if dim not in HEAD_DIMS or out.shape != k.shape or out.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"dq_from_stored: k and out must be [L, H, D] alike with D in {HEAD_DIMS} and unit last "
                         f"stride, got k {tuple(k.shape)} and out {tuple(out.shape)}")  # fmt: skip
    if scores.heads is not None and scores.heads != heads:
        raise ValueError(f"dq_from_stored: the buffer holds the tiles of {scores.heads} heads, k has {heads}")
    num_seqs = seq_offsets.shape[0] - 1
    if rows == 0 or num_seqs <= 0:
        return out
    tile_bound = num_seqs * heads * -(-max(max_seq_len, 1) // 64)
    tma = tma_loads(k) and scores.buffer.dtype == k.dtype and scores.buffer.data_ptr() % 16 == 0
    warps, stages, per_sm = LAUNCH
    with device_guard(k.device):
        grid = (num_programs(k.device, per_sm, tile_bound),)
        _dq_stored_kernel[grid](
            scores.buffer, scores.base, k, out, seq_offsets, num_targets if num_targets is not None else seq_offsets,
            queue_counter(k.device), k.stride(0), k.stride(1), out.stride(0), out.stride(1), num_seqs, heads, rows,
            scores.buffer.shape[0], float(alpha) / max_seq_len, DQK=dim, HAS_TARGETS=num_targets is not None,
            IEEE=k.dtype == torch.float32, INTERP=INTERPRET, CHUNK=CHUNK, TMA=tma,
            num_warps=1 if INTERPRET else warps, num_stages=1 if INTERPRET else stages,
        )  # fmt: skip
    return out
