"""What the Gluon attention kernels share (:mod:`gem_kernels.attention_gluon` and its ``_fwd``, ``_ws``,
``_dq`` and ``_dkdv`` kernels): Gluon's imports, whether they are there, the tile queue's scan and
lookup, the key blocks of a query block, the silu by ``tanh.approx``, the mask, and a ring slot's loads.
"""

from __future__ import annotations

try:  # Gluon ships with Triton 3.5+; its Hopper module is what these kernels need
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma  # noqa: F401
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401 (the host's descriptors)

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False


if HAVE_GLUON:

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

    @gluon.jit
    def _weights(s, half_alpha, queries, keys, seq_len, history_len, MASKED: gl.constexpr):
        """``silu(alpha s)`` with ``h = alpha s / 2``, ``t = tanh(h)``: ``h + h t``; masked per KERNELS.md."""
        h = s * half_alpha
        w = h + h * _tanh_approx(h)
        if MASKED:
            p_query = gl.minimum(queries, history_len)
            p_key = gl.minimum(keys, history_len)
            keep = (p_key[None, :] < p_query[:, None]) | (queries[:, None] == keys[None, :])
            keep = keep & (keys < seq_len)[None, :]
            w = gl.where(keep, w, 0.0)
        return w

    @gluon.jit
    def _load_kv(k_desc, v_desc, k_smem, v_smem, bars, slot, row, k_col, v_col, pred):
        bar = bars.index(slot)
        mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [row, k_col], bar, k_smem.index(slot), pred=pred)
        tma.async_copy_global_to_shared(v_desc, [row, v_col], bar, v_smem.index(slot), pred=pred)

    @gluon.jit
    def _block_start(i, n_hist, diag_lo, BLOCK_N: gl.constexpr):
        """The ``i``-th key block of a query block: the history's blocks, then those of its diagonal."""
        return gl.where(i < n_hist, i * BLOCK_N, diag_lo + (i - n_hist) * BLOCK_N)

    @gluon.jit
    def _tile_of(tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS,
                 HAS_TARGETS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Queue entry ``tile``: first row, length, head, first query row, history length, and its key
        blocks (``full_hi``: end of the unmasked ones; ``n_hist`` history blocks, then the diagonal's
        from ``diag_lo``; ``n_blocks`` in all)."""
        before = tiles_end <= tile
        seq = chunk0 + gl.sum(before.to(gl.int32), 0)
        first_tile = tiles_before + gl.sum(gl.where(before, tiles, 0), 0)
        seq_start = gl.load(SEQ_OFFSETS + seq).to(gl.int32)
        seq_len = (gl.load(SEQ_OFFSETS + seq + 1) - seq_start).to(gl.int32)
        blocks = (seq_len + BLOCK_M - 1) // BLOCK_M
        rank = tile - first_tile
        head = rank // blocks
        m0 = (blocks - 1 - (rank - head * blocks)) * BLOCK_M
        if HAS_TARGETS:
            targets = gl.load(NUM_TARGETS + seq).to(gl.int32)
            history_len = gl.minimum(gl.maximum(seq_len - targets, 0), seq_len)
        else:
            history_len = seq_len
        rows_end = gl.minimum(m0 + BLOCK_M, seq_len)
        min_p = gl.minimum(m0, history_len)
        max_p = gl.minimum(rows_end - 1, history_len)
        full_hi = min_p // BLOCK_N * BLOCK_N
        n_hist = (max_p + BLOCK_N - 1) // BLOCK_N
        diag_lo = gl.maximum(m0 // BLOCK_N * BLOCK_N, n_hist * BLOCK_N)
        n_blocks = n_hist + (gl.maximum(rows_end - diag_lo, 0) + BLOCK_N - 1) // BLOCK_N
        return seq_start, seq_len, head, m0, history_len, full_hi, n_hist, diag_lo, n_blocks

