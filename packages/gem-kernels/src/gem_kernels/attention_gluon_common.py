"""What the Gluon attention kernels share (:mod:`gem_kernels.attention_gluon` and its ``_fwd``, ``_ws``,
``_dq`` and ``_dkdv`` kernels): Gluon's imports, whether they are there, the tile queue's scan and
lookup, the key blocks of a query block, the silu by ``tanh.approx``, the mask (and a key block's weights
with it or without), the mbarriers' setup and teardown, and the ring's slots: their loads, the wait for
one, and its hand-back to the producer warp or its refill.
"""

from __future__ import annotations

try:  # Gluon ships with Triton 3.5+; its Hopper module is what these kernels need
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (  # noqa: F401
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 (the host's descriptors)

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False


if HAVE_GLUON:
    # every thread of the program at one point: ``thread_barrier`` in Triton 3.6, ``barrier`` from 3.7
    cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before,
                    BLOCK: gl.constexpr, CHUNK: gl.constexpr, layout: gl.constexpr):
        """Per sequence of ``chunk0 .. chunk0 + CHUNK``: its tile count and the queue index past its last
        tile (the Triton kernel's ``scan_chunk``)."""
        seqs = chunk0 + gl.arange(0, CHUNK, layout=layout)
        inside = seqs < num_seqs
        starts = gl.load(SEQ_OFFSETS + seqs, mask=inside, other=0)
        ends = gl.load(SEQ_OFFSETS + seqs + 1, mask=inside, other=0)
        tiles = ((ends - starts + BLOCK - 1) // BLOCK).to(gl.int32) * num_heads
        return tiles, gl.associative_scan(tiles, 0, _add) + tiles_before

    @gluon.jit
    def _tanh_approx(x):
        return gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=gl.float32,
                                         is_pure=True, pack=1)

    @gluon.constexpr_function
    def mma_layout(num_warps, n):
        """The ``wgmma`` accumulator layout of a ``[num_warps * 16, n]`` tile (instructions ``m64 n k16``)."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])

    @gluon.jit
    def _init_barriers(bars, COUNT: gl.constexpr):
        for i in gl.static_range(COUNT):
            mbarrier.init(bars.index(i), count=1)

    @gluon.jit
    def _invalidate_barriers(bars, COUNT: gl.constexpr):
        for i in gl.static_range(COUNT):
            mbarrier.invalidate(bars.index(i))

    @gluon.jit
    def _tile_barriers(STAGES: gl.constexpr):
        """The mbarriers of a one-partition kernel, initialized and fenced: one for the operand a tile keeps
        (loaded once a tile) and the ring's ``STAGES``."""
        tile_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ring_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(tile_bar, count=1)
        _init_barriers(ring_bars, STAGES)
        fence_async_shared()
        return tile_bar, ring_bars

    @gluon.jit
    def _invalidate_tile_barriers(tile_bar, ring_bars, STAGES: gl.constexpr):
        """:func:`_tile_barriers`' mbarriers, invalidated at the program's end."""
        mbarrier.invalidate(tile_bar)
        _invalidate_barriers(ring_bars, STAGES)

    @gluon.jit
    def _ws_barriers(STAGES: gl.constexpr):
        """The mbarriers of a warp-specialized kernel, initialized and fenced: ``tile_ready`` and ``tile_empty``
        of the two slots of the operand a tile keeps (the next tile's loads while this one runs), and
        ``ready`` and ``empty`` of the ring's ``STAGES`` slots. A slot is loaded on ``*_ready`` and handed back
        to the producer warp on ``*_empty``."""
        tile_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tile_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        _init_barriers(tile_ready, 2)
        _init_barriers(tile_empty, 2)
        _init_barriers(ready, STAGES)
        _init_barriers(empty, STAGES)
        fence_async_shared()
        return tile_ready, tile_empty, ready, empty

    @gluon.jit
    def _invalidate_ws_barriers(tile_ready, tile_empty, ready, empty, STAGES: gl.constexpr):
        """:func:`_ws_barriers`' mbarriers, invalidated at the program's end."""
        _invalidate_barriers(tile_ready, 2)
        _invalidate_barriers(tile_empty, 2)
        _invalidate_barriers(ready, STAGES)
        _invalidate_barriers(empty, STAGES)

    @gluon.jit
    def _release_queue(COUNTER):
        """Every program's last act: the last one out zeroes the tile queue for the next launch (the
        Triton kernels' ``release_queue``)."""
        done = gl.atomic_add(COUNTER + 1, 1)
        if done == gl.num_programs(0) - 1:
            gl.atomic_xchg(COUNTER, 0)
            gl.atomic_xchg(COUNTER + 1, 0)

    @gluon.jit
    def _allowed(rows, cols, seq_len, history_len, QUERY_ROWS: gl.constexpr):
        """KERNELS.md's mask ``i == j or p(j) < p(i)`` (``p = min(., history_len)``) on a tile whose rows
        are queries and columns keys (``QUERY_ROWS``), or the other way round; and no key (or query) past
        the sequence: the tiles that TMA loads hold the next sequence's rows there."""
        p_rows = gl.minimum(rows, history_len)[:, None]
        p_cols = gl.minimum(cols, history_len)[None, :]
        if QUERY_ROWS:
            keep = p_cols < p_rows
        else:
            keep = p_rows < p_cols
        return (keep | (rows[:, None] == cols[None, :])) & (cols < seq_len)[None, :]

    @gluon.jit
    def _weights(s, half_alpha, queries, keys, seq_len, history_len, MASKED: gl.constexpr):
        """``silu(alpha s)`` with ``h = alpha s / 2``, ``t = tanh(h)``: ``h + h t``; masked per KERNELS.md."""
        h = s * half_alpha
        w = h + h * _tanh_approx(h)
        if MASKED:
            w = gl.where(_allowed(queries, keys, seq_len, history_len, True), w, 0.0)
        return w

    @gluon.jit
    def _block_weights(s, i, n_hist, diag_lo, full_hi, half_alpha, queries, cols, seq_len, history_len,
                       BLOCK_N: gl.constexpr):
        """:func:`_weights` of a query tile's ``i``-th key block (scores ``s``; ``cols`` the block's columns
        from 0), with the mask's math only where the block reaches past the unmasked ones (``full_hi``)."""
        start = _block_start(i, n_hist, diag_lo, BLOCK_N)
        if start + BLOCK_N > full_hi:
            w = _weights(s, half_alpha, queries, start + cols, seq_len, history_len, True)
        else:
            w = _weights(s, half_alpha, queries, start + cols, seq_len, history_len, False)
        return w

    @gluon.jit
    def _load_pair(a_desc, b_desc, a_smem, b_smem, bars, slot, row, a_col, b_col, pred):
        """Tiles of two row-aligned tensors (k and v; q and g) into ring ``slot``, on its barrier."""
        bar = bars.index(slot)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(a_desc, [row, a_col], bar, a_smem.index(slot), pred=pred)
        tma.async_copy_global_to_shared(b_desc, [row, b_col], bar, b_smem.index(slot), pred=pred)

    @gluon.jit
    def _ring_wait(ready, n, STAGES: gl.constexpr):
        """Wait for the ring's ``n``-th block (counted over the program's tiles: slot ``n % STAGES``, its
        ``n // STAGES``-th fill) to land on its barrier in ``ready``; its slot."""
        slot = n % STAGES
        mbarrier.wait(ready.index(slot), (n // STAGES) & 1)
        return slot

    @gluon.jit
    def _hand_back(empty, slot, WS: gl.constexpr):
        """With a producer warp (``WS``): ring ``slot``, whose MMAs have retired, goes back to it on ``empty``."""
        if WS:
            mbarrier.arrive(empty.index(slot), count=1)

    @gluon.jit
    def _pass_slot(a_desc, b_desc, a_smem, b_smem, ready, empty, slot, row, a_col, b_col, pred, WS: gl.constexpr):
        """Ring ``slot``, whose MMAs have retired: back to the producer warp (``WS``), or refilled here with the
        tiles at ``row`` (where ``pred``: a block is left to load)."""
        if WS:
            _hand_back(empty, slot, WS)
        else:
            _load_pair(a_desc, b_desc, a_smem, b_smem, ready, slot, row, a_col, b_col, pred)

    @gluon.jit
    def _block_start(i, n_hist, diag_lo, BLOCK_N: gl.constexpr):
        """The ``i``-th key block of a query block: the history's blocks, then those of its diagonal."""
        return gl.where(i < n_hist, i * BLOCK_N, diag_lo + (i - n_hist) * BLOCK_N)

    @gluon.jit
    def _locate(tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS,
                HAS_TARGETS: gl.constexpr, BLOCK: gl.constexpr):
        """Queue entry ``tile`` (the Triton kernels' ``locate_tile``): its sequence's first row and length,
        its head, its block's index within the sequence and the sequence's block count, the history
        length ``n - targets`` (clamped to ``[0, n]``), and the sequence's index."""
        before = tiles_end <= tile
        seq = chunk0 + gl.sum(before.to(gl.int32), 0)
        first_tile = tiles_before + gl.sum(gl.where(before, tiles, 0), 0)
        seq_start = gl.load(SEQ_OFFSETS + seq).to(gl.int32)
        seq_len = (gl.load(SEQ_OFFSETS + seq + 1) - seq_start).to(gl.int32)
        blocks = (seq_len + BLOCK - 1) // BLOCK
        rank = tile - first_tile
        head = rank // blocks
        if HAS_TARGETS:
            targets = gl.load(NUM_TARGETS + seq).to(gl.int32)
            history_len = gl.minimum(gl.maximum(seq_len - targets, 0), seq_len)
        else:
            history_len = seq_len
        return seq_start, seq_len, head, rank - head * blocks, blocks, history_len, seq

    @gluon.jit
    def _tile_of(tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS,
                 HAS_TARGETS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Queue entry ``tile`` of the query-major kernels: first row, length, head, first query row (the
        sequence's last block first: it sees the most keys), history length, and its key blocks
        (``full_hi``: end of the unmasked ones; ``n_hist`` history blocks, then the diagonal's from
        ``diag_lo``; ``n_blocks`` in all)."""
        seq_start, seq_len, head, block, blocks, history_len, _ = _locate(
            tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS, HAS_TARGETS, BLOCK_M)
        m0 = (blocks - 1 - block) * BLOCK_M
        rows_end = gl.minimum(m0 + BLOCK_M, seq_len)
        min_p = gl.minimum(m0, history_len)
        max_p = gl.minimum(rows_end - 1, history_len)
        full_hi = min_p // BLOCK_N * BLOCK_N
        n_hist = (max_p + BLOCK_N - 1) // BLOCK_N
        diag_lo = gl.maximum(m0 // BLOCK_N * BLOCK_N, n_hist * BLOCK_N)
        n_blocks = n_hist + (gl.maximum(rows_end - diag_lo, 0) + BLOCK_N - 1) // BLOCK_N
        return seq_start, seq_len, head, m0, history_len, full_hi, n_hist, diag_lo, n_blocks

    @gluon.jit
    def _store_rows(acc, OUT, seq_start, m0, head, seq_len, stride_om, stride_oh, scale,
                    BLOCK_M: gl.constexpr, D: gl.constexpr, NUM_WARPS: gl.constexpr):
        """``acc * scale`` into the tile's rows of ``OUT`` (``[L, H, D]``), none past the sequence."""
        layout: gl.constexpr = mma_layout(NUM_WARPS, D)
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
        out_rows = (seq_start + m0 + rows).to(gl.int64)
        ptrs = OUT + out_rows[:, None] * stride_om + head * stride_oh + cols[None, :]
        gl.store(ptrs, (acc * scale).to(OUT.dtype.element_ty), mask=((m0 + rows) < seq_len)[:, None])
