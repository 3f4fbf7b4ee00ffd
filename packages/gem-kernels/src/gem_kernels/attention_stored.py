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

e4m3 tiles (``dq_mode="stored_e4m3"``). The tiles may be kept in e4m3 instead, half the bytes each way, with
one float32 scale per key of each tile: ``scales[t, c] = amax / 448`` over the tile's 32 queries of key ``c``,
the tile holding ``ds / scales[t, c]`` (a zero column holds zeros and scale 0). A writer takes each key's amax
from its own 32-query step (the Gluon pass's ``n64m32`` step; the Triton pass then steps 32 queries at a
time), a reduction within a warp's rows. On random data (``benchmarks/stored_ds_precision.py``, CPU, float64)
``dq``'s relative error is ~2.6 % against 0.24 % from bf16 tiles: the e4m3 mantissa, not the scales' grain,
sets it; an fp8 option, off by default.

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
from gem_kernels.quantized_rows_triton import e4m3_bits

TILE_Q, TILE_K = 32, 64
"""Queries and keys of a stored tile (the Gluon ``dk``/``dv`` pass's ``n64m32`` step)."""
E4M3 = torch.float8_e4m3fn
"""The dtype of ``stored_e4m3``'s tiles; :data:`E4M3_MAX` is its largest finite value."""
E4M3_MAX = 448.0
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
def store_tile_e4m3(DS, SC, base, ds_t, keys, start, n):
    """Store a ``[keys, 32]`` float32 tile of ``ds`` (queries ``start .. start + 32``, ``start`` a multiple of 32:
    one stored tile's rows) in e4m3, scaled per key, with its scales (``stored_e4m3``)."""
    amax = tl.max(tl.abs(ds_t), axis=1)
    inverse = 448.0 / tl.maximum(amax, 1e-30)  # a zero key stays zero, with no inf on the way
    scaled = tl.clamp(ds_t * inverse[:, None], -448.0, 448.0)  # e4m3_bits: nearest even, under the interpreter too
    ds8 = e4m3_bits(scaled).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    store_tile_elements(DS, base, ds8, keys, start + tl.arange(0, 32), n)
    j = keys // 64
    i = start // 32
    exists = (i >= 2 * j) & (start < (n + 31) // 32 * 32) & (keys < (n + 63) // 64 * 64)
    tl.store(SC + tile_index(base, j, i, n) * 64 + keys % 64, amax * (1.0 / 448.0), mask=exists)


@triton.jit
def _load_pair(DS, SC, ds_desc, k_head, k_desc, rows, keys, k_row, k_col, offs_m, offs_n, offs_d, stride_km, keys_ok,
               TMA: tl.constexpr, MASKED: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
    """A ``[64, 64]`` block of stored ``ds`` from row ``rows`` (int64) on, and the ``[64, D]`` key tile of keys
    ``keys`` (``k_row``, ``k_col``: its first row and column in the whole ``[L, H D]`` tensor). By descriptors,
    rows past the sequence hold the next one's keys (past the tensor, zeros): a masked step's selection
    drops them. ``SCALED``: e4m3 tiles, widened here by their per-key scales (``SC``, 64 a tile) to ``k``'s
    dtype."""
    if TMA:
        ds = ds_desc.load([rows.to(tl.int32), 0])
        k = k_desc.load([k_row, k_col])
    else:
        ds = tl.load(DS + (rows + offs_m)[:, None] * 64 + offs_n[None, :])
        if MASKED:
            k = tl.load(k_head + keys[:, None] * stride_km + offs_d[None, :], mask=keys_ok[:, None], other=0.0)
        else:
            k = tl.load(k_head + keys[:, None] * stride_km + offs_d[None, :])
    if SCALED:  # tiles rows // 32 and the next: queries 0-31 and 32-63 of the block
        first = tl.load(SC + rows * 2 + offs_n)
        second = tl.load(SC + rows * 2 + 64 + offs_n)
        scale = tl.where((offs_m < 32)[:, None], first[None, :], second[None, :])
        ds = (ds.to(tl.float32) * scale).to(k.dtype)
    return ds, k


@triton.jit(do_not_specialize=["num_seqs", "num_heads", "num_rows", "ds_rows"])
def _dq_stored_kernel(DS, SC, DS_BASE, K, DQ, SEQ_OFFSETS, NUM_TARGETS, COUNTER, stride_km, stride_kh, stride_dqm,
                      stride_dqh, num_seqs, num_heads, num_rows, ds_rows, scale, DQK: tl.constexpr,
                      HAS_TARGETS: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr, CHUNK: tl.constexpr,
                      TMA: tl.constexpr, SCALED: tl.constexpr):  # fmt: skip
    """``dq = scale * ds k`` for every (sequence, head, block of 64 queries), the sequence's last block first;
    ``TMA``: the ``ds`` blocks and key tiles by tensor descriptors (``DS`` ``[ds_rows, 64]``, ``K`` ``[num_rows,
    num_heads * DQK]``); ``SCALED``: e4m3 tiles with their scales in ``SC``."""
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
                ds, k = _load_pair(DS, SC, ds_desc, k_head, k_desc, rows, keys, (seq_start + j * 64).to(tl.int32),
                                   k_col, offs_m, offs_n, offs_d, stride_km, keys, TMA, False, SCALED)  # fmt: skip
                acc = dot(ds, k, acc, IEEE, INTERP)
            for j in range(full_end, p + 1):
                keys = j * 64 + offs_n
                keys_ok = keys < seq_len
                rows = tile_index(base, j, 2 * p, seq_len) * 32
                ds, k = _load_pair(DS, SC, ds_desc, k_head, k_desc, rows, keys, (seq_start + j * 64).to(tl.int32),
                                   k_col, offs_m, offs_n, offs_d, stride_km, keys_ok, TMA, True, SCALED)  # fmt: skip
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
    that many heads at a time; ``None``: every head of the call). e4m3 tiles come with ``scales [tiles + 1,
    64]`` (float32, one a key of each tile, the spare tile's too)."""

    buffer: torch.Tensor
    base: torch.Tensor
    heads: int | None = None
    scales: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if (self.buffer.dtype == E4M3) != (self.scales is not None):
            raise ValueError(f"StoredScores: e4m3 tiles need their scales and other tiles have none, got a "
                             f"{self.buffer.dtype} buffer and scales {None if self.scales is None else 'given'}")  # fmt: skip
        if self.scales is not None and (self.scales.dtype != torch.float32
                                        or tuple(self.scales.shape) != (self.buffer.shape[0] // TILE_Q, TILE_K)):  # fmt: skip
            raise ValueError(f"StoredScores: scales must be float32 [{self.buffer.shape[0] // TILE_Q}, {TILE_K}] "
                             f"(one a key of each tile), got {self.scales.dtype} {tuple(self.scales.shape)}")  # fmt: skip


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
        spare one (in :data:`E4M3`, with their scales)."""
        per_tile = TILE_Q * TILE_K * dtype.itemsize + (TILE_K * 4 if dtype == E4M3 else 0)
        return (self.tiles(heads) + 1) * per_tile

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
        tiles, device = self.tiles(heads) + 1, self._head_base.device
        try:
            buffer = torch.empty((tiles * TILE_Q, TILE_K), dtype=dtype, device=device)
            scales = torch.empty((tiles, TILE_K), dtype=torch.float32, device=device) if dtype == E4M3 else None
        except torch.OutOfMemoryError:  # the step goes on, recomputing; it only runs slower
            return None
        return StoredScores(buffer, self.base_for(heads), heads, scales)


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
    scaled = scores.scales is not None
    tma = (tma_loads(k) and scores.buffer.dtype in (k.dtype, E4M3)
           and scores.buffer.data_ptr() % 16 == 0)  # fmt: skip
    warps, stages, per_sm = LAUNCH
    with device_guard(k.device):
        grid = (num_programs(k.device, per_sm, tile_bound),)
        _dq_stored_kernel[grid](
            scores.buffer, scores.scales if scaled else scores.base, scores.base, k, out, seq_offsets,
            num_targets if num_targets is not None else seq_offsets, queue_counter(k.device), k.stride(0),
            k.stride(1), out.stride(0), out.stride(1), num_seqs, heads, rows, scores.buffer.shape[0],
            float(alpha) / max_seq_len, DQK=dim, HAS_TARGETS=num_targets is not None, IEEE=k.dtype == torch.float32,
            INTERP=INTERPRET, CHUNK=CHUNK, TMA=tma, SCALED=scaled,
            num_warps=1 if INTERPRET else warps, num_stages=1 if INTERPRET else stages,
        )  # fmt: skip
    return out
