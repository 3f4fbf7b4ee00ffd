"""The Gluon attention forward's kernel (one partition); :func:`gem_kernels.attention_gluon.forward`
launches it, and its module docstring describes the schedule."""

from __future__ import annotations

from gem_kernels.attention_gluon_common import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from gem_kernels.attention_gluon_common import (
        _block_start,
        _block_weights,
        _hand_back,
        _invalidate_tile_barriers,
        _load_pair,
        _pass_slot,
        _release_queue,
        _ring_wait,
        _scan_chunk,
        _store_rows,
        _tile_barriers,
        _tile_of,
        mma_layout,
    )

    @gluon.jit
    def _forward_steps(q_tile, k_smem, v_smem, ready, empty, loads, n_blocks, n_hist, diag_lo, full_hi, m0, seq_len,
                       history_len, half_alpha, k_desc, v_desc, kv_row, k_col, v_col, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                       WS: gl.constexpr):
        """One query tile's output (float32, before the ``1 / N``) over its ``n_blocks`` key blocks, whose
        k and v come through the ring: block ``b`` in slot ``(loads + b) % STAGES`` on barrier ``ready``.
        A slot whose MMAs have retired is refilled here with the block ``STAGES`` ahead (one partition),
        or handed back on ``empty`` to the producer warp (``WS``)."""
        dtype: gl.constexpr = q_tile.dtype
        s_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_N)
        o_layout: gl.constexpr = mma_layout(NUM_WARPS, DV)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        queries = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zeros = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

        # block 0: its scores alone
        slot = _ring_wait(ready, loads, STAGES)
        s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        w = _block_weights(s, 0, n_hist, diag_lo, full_hi, half_alpha, queries, cols, seq_len, history_len, BLOCK_N)
        p = gl.convert_layout(w.to(dtype), p_layout)
        acc = gl.zeros([BLOCK_M, DV], gl.float32, o_layout)
        for i in range(1, n_blocks):
            prev = (loads + i - 1) % STAGES
            slot = _ring_wait(ready, loads + i, STAGES)
            s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=[s])  # this block's scores; the previous P v may run on
            w = _block_weights(s, i, n_hist, diag_lo, full_hi, half_alpha, queries, cols, seq_len, history_len, BLOCK_N)
            acc = warpgroup_mma_wait(0, deps=[acc, p])[0]
            p = gl.convert_layout(w.to(dtype), p_layout)
            nxt = i - 1 + STAGES  # block i - 1's slot: to the producer, or it takes block i - 1 + STAGES
            _pass_slot(k_desc, v_desc, k_smem, v_smem, ready, empty, prev,
                       kv_row + _block_start(nxt, n_hist, diag_lo, BLOCK_N), k_col, v_col, nxt < n_blocks, WS)
        last = (loads + n_blocks - 1) % STAGES
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _hand_back(empty, last, WS)
        return acc

    @gluon.jit(do_not_specialize=["num_seqs", "num_heads"])
    def forward_kernel(
        q_desc, k_desc, v_desc, OUT, SEQ_OFFSETS, NUM_TARGETS, COUNTER,
        stride_om, stride_oh, num_seqs, num_heads, half_alpha, out_scale,
        HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        DQK: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr, QUERY_REGS: gl.constexpr,
    ):
        """``QUERY_REGS``: each tile's queries go from shared memory into registers once, and every
        ``q k^T`` takes them from there (``wgmma``'s register operand), so that its narrow MMAs read only
        the key tile from shared memory (the ``qr_*`` configs)."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        dtype: gl.constexpr = q_desc.dtype
        chunk_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout(NUM_WARPS, BLOCK_N), k_width=2)
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DQK], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DQK], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], v_desc.layout)
        q_bar, kv_bars = _tile_barriers(STAGES)

        loads = 0  # key/value tiles loaded by this program so far: slot and phase of the next one
        q_phase = 0
        tile = gl.atomic_add(COUNTER, 1, sem="relaxed")
        tiles_before = tile * 0
        for chunk0 in range(0, num_seqs, CHUNK):
            tiles, tiles_end = _scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before,
                                           BLOCK_M, CHUNK, chunk_layout)
            chunk_end = tiles_before + gl.sum(tiles, 0)
            while tile < chunk_end:
                seq_start, seq_len, head, m0, history_len, full_hi, n_hist, diag_lo, n_blocks = _tile_of(
                    tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS, HAS_TARGETS,
                    BLOCK_M, BLOCK_N)
                next_tile = gl.atomic_add(COUNTER, 1, sem="relaxed")
                mbarrier.expect(q_bar, q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [seq_start + m0, head * DQK], q_bar, q_smem)
                for i in gl.static_range(STAGES):  # fill the ring
                    _load_pair(k_desc, v_desc, k_smem, v_smem, kv_bars, (loads + i) % STAGES,
                               seq_start + _block_start(i, n_hist, diag_lo, BLOCK_N), head * DQK, head * DV,
                               i < n_blocks)
                mbarrier.wait(q_bar, q_phase)
                q_phase ^= 1
                if QUERY_REGS:
                    q_op = q_smem.load(q_layout)
                else:
                    q_op = q_smem
                acc = _forward_steps(q_op, k_smem, v_smem, kv_bars, kv_bars, loads, n_blocks, n_hist, diag_lo,
                                     full_hi, m0, seq_len, history_len, half_alpha, k_desc, v_desc, seq_start,
                                     head * DQK, head * DV, BLOCK_M, BLOCK_N, DV, STAGES, NUM_WARPS, False)
                loads += n_blocks  # block b of a tile went to slot (loads + b) % STAGES
                _store_rows(acc, OUT, seq_start, m0, head, seq_len, stride_om, stride_oh, out_scale, BLOCK_M, DV,
                            NUM_WARPS)
                tile = next_tile
            tiles_before = chunk_end
        _invalidate_tile_barriers(q_bar, kv_bars, STAGES)
        _release_queue(COUNTER)
