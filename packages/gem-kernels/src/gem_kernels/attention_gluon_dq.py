"""The attention backward's ``dq`` pass for Hopper (sm_90) in Gluon, with the forward's schedule
(:mod:`gem_kernels.attention_gluon`): the Triton ``query_major`` kernel's ``dq`` mode, which
:func:`gem_kernels.attention_triton.query_major` routes here when :data:`gem_kernels.attention_gluon.DQ`
is on.

Per query tile (``s = alpha q k^T``, ``g`` the output's gradient)::

    dq = alpha / N * sum over key blocks of (mask * (g v^T) * silu'(s)) k

Each step issues ``S_i = q k_i^T`` and ``dP_i = g v_i^T`` with the previous block's ``dq += ds_{i-1} k_{i-1}``
as asynchronous ``wgmma``, waits for the first two only (``wgmma.wait_group 1``), and computes ``ds_i``
(``silu'`` by one ``tanh.approx``, as the Triton kernel) while the tensor cores run the third. ``ds``
goes to its MMA from registers; ``q`` and ``g`` of the tile, and the ring's ``k`` and ``v``, by TMA.
"""

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
        _allowed,
        _block_start,
        _hand_back,
        _invalidate_tile_barriers,
        _load_pair,
        _pass_slot,
        _release_queue,
        _ring_wait,
        _scan_chunk,
        _store_rows,
        _tanh_approx,
        _tile_barriers,
        _tile_of,
        mma_layout,
    )
    from gem_kernels.attention_gluon_ws import _query_major_ws

    @gluon.jit
    def _score_grads(s, dp, half_alpha, queries, keys, seq_len, history_len, MASKED: gl.constexpr):
        """``dP * silu'(alpha s)``: with ``h = alpha s / 2``, ``t = tanh(h)``, ``silu' = (1 + t) / 2 *
        (1 + h - h t)``; masked per KERNELS.md."""
        h = s * half_alpha
        t = _tanh_approx(h)
        ht = h * t
        w = dp * ((0.5 + 0.5 * t) * (1.0 + h - ht))
        if MASKED:
            w = gl.where(_allowed(queries, keys, seq_len, history_len, True), w, 0.0)
        return w

    @gluon.jit
    def _block_score_grads(s, dp, i, n_hist, diag_lo, full_hi, half_alpha, queries, cols, seq_len, history_len,
                           BLOCK_N: gl.constexpr):
        """:func:`_score_grads` of a query tile's ``i``-th key block (``cols`` its columns from 0), with the
        mask's math only where the block reaches past the unmasked ones (``full_hi``)."""
        start = _block_start(i, n_hist, diag_lo, BLOCK_N)
        if start + BLOCK_N > full_hi:
            w = _score_grads(s, dp, half_alpha, queries, start + cols, seq_len, history_len, True)
        else:
            w = _score_grads(s, dp, half_alpha, queries, start + cols, seq_len, history_len, False)
        return w

    @gluon.jit
    def _dq_steps(q_tile, do_tile, k_smem, v_smem, ready, empty, loads, n_blocks, n_hist, diag_lo, full_hi, m0,
                  seq_len, history_len, half_alpha, k_desc, v_desc, kv_row, k_col, v_col, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, DQK: gl.constexpr, STAGES: gl.constexpr, NUM_WARPS: gl.constexpr,
                  WS: gl.constexpr):
        """One query tile's ``dq`` (float32, before ``alpha / N``) over its ``n_blocks`` key blocks, whose
        k and v come through the ring (block ``b`` in slot ``(loads + b) % STAGES`` on ``ready``); a
        retired slot is refilled here (one partition) or handed back on ``empty`` (``WS``)."""
        dtype: gl.constexpr = q_tile.dtype
        s_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_N)
        o_layout: gl.constexpr = mma_layout(NUM_WARPS, DQK)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        queries = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        zeros = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)

        slot = _ring_wait(ready, loads, STAGES)
        s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_tile, v_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        s, dp = warpgroup_mma_wait(0, deps=[s, dp])
        w = _block_score_grads(s, dp, 0, n_hist, diag_lo, full_hi, half_alpha, queries, cols, seq_len,
                               history_len, BLOCK_N)
        ds = gl.convert_layout(w.to(dtype), p_layout)
        acc = gl.zeros([BLOCK_M, DQK], gl.float32, o_layout)
        for i in range(1, n_blocks):
            prev = (loads + i - 1) % STAGES
            slot = _ring_wait(ready, loads + i, STAGES)
            s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
            dp = warpgroup_mma(do_tile, v_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
            acc = warpgroup_mma(ds, k_smem.index(prev), acc, is_async=True)
            s, dp = warpgroup_mma_wait(1, deps=[s, dp])  # this block's; the previous ds k may run on
            w = _block_score_grads(s, dp, i, n_hist, diag_lo, full_hi, half_alpha, queries, cols, seq_len,
                                   history_len, BLOCK_N)
            acc = warpgroup_mma_wait(0, deps=[acc, ds])[0]
            ds = gl.convert_layout(w.to(dtype), p_layout)
            nxt = i - 1 + STAGES  # block i - 1's slot: to the producer, or it takes block i - 1 + STAGES
            _pass_slot(k_desc, v_desc, k_smem, v_smem, ready, empty, prev,
                       kv_row + _block_start(nxt, n_hist, diag_lo, BLOCK_N), k_col, v_col, nxt < n_blocks, WS)
        last = (loads + n_blocks - 1) % STAGES
        acc = warpgroup_mma(ds, k_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        _hand_back(empty, last, WS)
        return acc

    @gluon.jit(do_not_specialize=["num_seqs", "num_heads"])
    def dq_kernel(
        q_desc, do_desc, k_desc, v_desc, DQ, SEQ_OFFSETS, NUM_TARGETS, COUNTER,
        stride_om, stride_oh, num_seqs, num_heads, half_alpha, out_scale,
        HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        DQK: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
    ):
        NUM_WARPS: gl.constexpr = gl.num_warps()
        dtype: gl.constexpr = q_desc.dtype
        chunk_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DQK], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DV], do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DQK], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], v_desc.layout)
        q_bar, kv_bars = _tile_barriers(STAGES)

        loads = 0
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
                mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [seq_start + m0, head * DQK], q_bar, q_smem)
                tma.async_copy_global_to_shared(do_desc, [seq_start + m0, head * DV], q_bar, do_smem)
                for i in gl.static_range(STAGES):
                    _load_pair(k_desc, v_desc, k_smem, v_smem, kv_bars, (loads + i) % STAGES,
                               seq_start + _block_start(i, n_hist, diag_lo, BLOCK_N), head * DQK, head * DV,
                               i < n_blocks)
                mbarrier.wait(q_bar, q_phase)
                q_phase ^= 1
                acc = _dq_steps(q_smem, do_smem, k_smem, v_smem, kv_bars, kv_bars, loads, n_blocks, n_hist, diag_lo,
                                full_hi, m0, seq_len, history_len, half_alpha, k_desc, v_desc, seq_start, head * DQK,
                                head * DV, BLOCK_M, BLOCK_N, DQK, STAGES, NUM_WARPS, False)
                loads += n_blocks
                _store_rows(acc, DQ, seq_start, m0, head, seq_len, stride_om, stride_oh, out_scale, BLOCK_M, DQK,
                            NUM_WARPS)
                tile = next_tile
            tiles_before = chunk_end
        _invalidate_tile_barriers(q_bar, kv_bars, STAGES)
        _release_queue(COUNTER)

    @gluon.jit(do_not_specialize=["num_seqs", "num_heads"])
    def dq_ws_kernel(
        q_desc, do_desc, k_desc, v_desc, DQ, SEQ_OFFSETS, NUM_TARGETS,
        stride_om, stride_oh, num_seqs, num_heads, half_alpha, out_scale,
        HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        DQK: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """:func:`dq_kernel` with its loads in the forward's producer warp (``attention_gluon_ws._producer``,
        which also loads the output gradient's rows) and its math in the forward's consumer warps
        (``attention_gluon_ws._consumer`` with :func:`_dq_steps`): ``attention_gluon_ws._query_major_ws``; two
        query slots; tiles dealt statically."""
        _query_major_ws(q_desc, do_desc, k_desc, v_desc, DQ, SEQ_OFFSETS, NUM_TARGETS, stride_om, stride_oh, num_seqs,
                        num_heads, half_alpha, out_scale, HAS_TARGETS, CHUNK, BLOCK_M, BLOCK_N, DQK, DV, STAGES,
                        PRODUCER_REGS, _dq_steps, True)
