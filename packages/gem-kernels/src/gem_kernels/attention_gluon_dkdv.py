"""The attention backward's key-major ``dk``/``dv`` pass for Hopper (sm_90) in Gluon, with the forward's
schedule (:mod:`gem_kernels.attention_gluon`): the Triton ``key_major`` kernel without atomic ``dq`` and
without biases, which :func:`gem_kernels.attention_triton_bwd.key_major` routes here when
:data:`gem_kernels.attention_gluon.DKDV` is on.

One tile = (sequence, head, block of ``BLOCK_N`` keys); ``k`` and ``v`` stay in shared memory, the
``dk``, ``dv`` accumulators in registers (two warpgroups of 64 keys each), and the query blocks that see
the keys stream through a TMA ring of ``(q, g)`` tiles. Per query block, with ``s^T = alpha k q^T``::

    dv += (mask * silu(s^T)) g                   dk += (mask * (v g^T) * silu'(s^T)) q

Each step issues ``S^T_j = k q_j^T`` and ``dP^T_j = v g_j^T`` with the previous block's two accumulating
MMAs (``P^T_{j-1} g_{j-1}``, ``dS^T_{j-1} q_{j-1}``, their left operands from registers) as asynchronous
``wgmma``, waits for the first two only (``wgmma.wait_group 2``), and computes ``P^T_j`` and ``dS^T_j``
while the tensor cores run the other two. The query blocks and their masks are the Triton kernel's
(``_key_block_ranges``): the diagonal's blocks, then the unmasked ones, then the tail (rows past the last
whole block, and target rows).
"""

from __future__ import annotations

from gem_kernels.attention_gluon_common import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    from gem_kernels.attention_gluon_common import (
        _allowed,
        _hand_back,
        _invalidate_tile_barriers,
        _invalidate_ws_barriers,
        _load_pair,
        _locate,
        _pass_slot,
        _release_queue,
        _ring_wait,
        _scan_chunk,
        _tanh_approx,
        _tile_barriers,
        _ws_barriers,
        cta_barrier,
        mma_layout,
    )

    @gluon.jit
    def _key_tile_of(tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS,
                     HAS_TARGETS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        """Queue entry ``tile`` (key blocks, the first first): first row, length, head, first key, history
        length, and its query blocks: ``n_diag`` masked ones from ``diag_lo``, then from ``full_lo`` the
        unmasked ones up to ``full_hi`` and the masked tail, ``n_blocks`` in all."""
        seq_start, seq_len, head, block, _, history_len, seq = _locate(
            tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS, HAS_TARGETS, BLOCK_N)
        n0 = block * BLOCK_N
        keys_end = gl.minimum(n0 + BLOCK_N, seq_len)
        diag_lo = n0 // BLOCK_M * BLOCK_M
        full_lo = (keys_end + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        whole_blocks_end = seq_len // BLOCK_M * BLOCK_M  # unmasked blocks hold no row past the sequence
        rows_end = gl.where(n0 < history_len, seq_len, keys_end)  # target keys: seen by themselves only
        # a block holding a target key has no unmasked rows
        full_hi = gl.where(keys_end <= history_len, gl.maximum(whole_blocks_end, full_lo), full_lo)
        n_diag = (full_lo - diag_lo) // BLOCK_M
        n_rest = (full_hi - full_lo) // BLOCK_M + (gl.maximum(rows_end - full_hi, 0) + BLOCK_M - 1) // BLOCK_M
        return seq_start, seq_len, head, n0, history_len, diag_lo, full_lo, full_hi, n_diag, n_diag + n_rest, seq

    @gluon.jit
    def _query_start(i, n_diag, diag_lo, full_lo, BLOCK_M: gl.constexpr):
        return gl.where(i < n_diag, diag_lo + i * BLOCK_M, full_lo + (i - n_diag) * BLOCK_M)

    @gluon.jit
    def _grads_t(s_t, dp_t, half_alpha, keys, queries, seq_len, history_len, MASKED: gl.constexpr):
        """``silu(alpha s^T)`` and ``dP^T silu'(alpha s^T)`` on ``[keys, queries]`` tiles; masked per
        KERNELS.md, and no row past the sequence (the ring's tiles hold the next sequence's there)."""
        h = s_t * half_alpha
        t = _tanh_approx(h)
        ht = h * t
        p_t = h + ht
        ds_t = dp_t * ((0.5 + 0.5 * t) * (1.0 + h - ht))
        if MASKED:
            keep = _allowed(keys, queries, seq_len, history_len, False)
            p_t = gl.where(keep, p_t, 0.0)
            ds_t = gl.where(keep, ds_t, 0.0)
        return p_t, ds_t

    @gluon.jit
    def _store_ds(ds_t, ds_smem, ds_desc, step, row):
        """``ds^T`` of one step (``[keys, queries]``, the input dtype) as the ``[queries, keys]`` tile at ``row`` of
        the stored layout (:mod:`gem_kernels.attention_stored`): into shared slot ``step % 2`` (transposed on
        the way; ``step`` counts the program's steps over its tiles), then one bulk tensor store, issued
        and not waited for. The slot's last store, two steps back, is known done: the issuing thread waited
        for every store before the previous step's barrier, which this step's threads have passed."""
        ds_smem.index(step % 2).permute((1, 0)).store(ds_t)
        fence_async_shared()
        tma.store_wait(0)  # the previous step's store, a step old: then no thread writes its slot too early
        cta_barrier()
        tma.async_copy_shared_to_global(ds_desc, [row, 0], ds_smem.index(step % 2))

    # _ds_head and _ds_row are attention_stored.head_base and tile_index for Gluon, which calls no triton.jit
    # function: the layout's formulas, written once more here
    @gluon.jit
    def _ds_head(DS_BASE, seq, head, seq_len):
        """The first stored tile of (``seq``, ``head``): the sequence's base, then ``head`` times its tile count."""
        kb = (seq_len.to(gl.int64) + 63) // 64
        qb = (seq_len.to(gl.int64) + 31) // 32
        return gl.load(DS_BASE + seq) + head * (kb * qb - kb * (kb - 1))

    @gluon.jit
    def _ds_row(ds_head, j, start, qb):
        """The first row of the stored tile of (query block ``start // 32``, key block ``j``)."""
        return ((ds_head + j * qb - j * (j - 1) + start // 32 - 2 * j) * 32).to(gl.int32)

    @gluon.jit
    def _dkdv_steps(k_tile, v_tile, q_smem, do_smem, ready, empty, loads, n_blocks, n_diag, diag_lo, full_lo,
                    full_hi, n0, seq_len, history_len, half_alpha, q_desc, do_desc, q_row, q_col, do_col,
                    ds_smem, ds_desc, ds_head,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DQK: gl.constexpr, DVD: gl.constexpr,
                    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, WS: gl.constexpr, STORE_DS: gl.constexpr):
        """One key tile's ``dk`` and ``dv`` (float32, unscaled) over its ``n_blocks`` query blocks, whose
        ``(q, g)`` tiles come through the ring: block ``b`` in slot ``(loads + b) % STAGES`` on barrier
        ``ready``. A slot whose MMAs have retired is refilled here with the block ``STAGES`` ahead (one
        partition), or handed back on ``empty`` to the producer warp (``WS``). ``STORE_DS``: each step's ``ds``
        also goes to the stored layout (``ds_head``: this (sequence, head)'s first tile; 64-key tiles of
        32-query steps)."""
        dtype: gl.constexpr = q_smem.dtype
        s_layout: gl.constexpr = mma_layout(NUM_WARPS, BLOCK_M)
        dk_layout: gl.constexpr = mma_layout(NUM_WARPS, DQK)
        dv_layout: gl.constexpr = mma_layout(NUM_WARPS, DVD)
        pk_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)
        pv_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
        keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        zeros = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, s_layout)
        dk = gl.zeros([BLOCK_N, DQK], gl.float32, dk_layout)
        dv = gl.zeros([BLOCK_N, DVD], gl.float32, dv_layout)

        slot = _ring_wait(ready, loads, STAGES)
        s_t = warpgroup_mma(k_tile, q_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_tile, do_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
        s_t, dp_t = warpgroup_mma_wait(0, deps=[s_t, dp_t])
        start = _query_start(0, n_diag, diag_lo, full_lo, BLOCK_M)
        if (n_diag > 0) | (start >= full_hi):
            p_t, ds_t = _grads_t(s_t, dp_t, half_alpha, keys, start + cols, seq_len, history_len, True)
        else:
            p_t, ds_t = _grads_t(s_t, dp_t, half_alpha, keys, start + cols, seq_len, history_len, False)
        p_op = gl.convert_layout(p_t.to(dtype), pv_layout)
        ds_low = ds_t.to(dtype)
        ds_op = gl.convert_layout(ds_low, pk_layout)
        j = n0 // BLOCK_N
        qb = (seq_len + 31) // 32
        if STORE_DS:
            _store_ds(ds_low, ds_smem, ds_desc, loads, _ds_row(ds_head, j, start, qb))
        for i in range(1, n_blocks):
            prev = (loads + i - 1) % STAGES
            slot = _ring_wait(ready, loads + i, STAGES)
            s_t = warpgroup_mma(k_tile, q_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
            dp_t = warpgroup_mma(v_tile, do_smem.index(slot).permute((1, 0)), zeros, use_acc=False, is_async=True)
            dv = warpgroup_mma(p_op, do_smem.index(prev), dv, is_async=True)
            dk = warpgroup_mma(ds_op, q_smem.index(prev), dk, is_async=True)
            s_t, dp_t = warpgroup_mma_wait(2, deps=[s_t, dp_t])  # this block's; the previous two run on
            start = _query_start(i, n_diag, diag_lo, full_lo, BLOCK_M)
            if (i < n_diag) | (start >= full_hi):
                p_t, ds_t = _grads_t(s_t, dp_t, half_alpha, keys, start + cols, seq_len, history_len, True)
            else:
                p_t, ds_t = _grads_t(s_t, dp_t, half_alpha, keys, start + cols, seq_len, history_len, False)
            dv, dk, p_op, ds_op = warpgroup_mma_wait(0, deps=[dv, dk, p_op, ds_op])
            p_op = gl.convert_layout(p_t.to(dtype), pv_layout)
            ds_low = ds_t.to(dtype)
            ds_op = gl.convert_layout(ds_low, pk_layout)
            if STORE_DS:
                _store_ds(ds_low, ds_smem, ds_desc, loads + i, _ds_row(ds_head, j, start, qb))
            nxt = i - 1 + STAGES  # block i - 1's slot: to the producer, or it takes block i - 1 + STAGES
            _pass_slot(q_desc, do_desc, q_smem, do_smem, ready, empty, prev,
                       q_row + _query_start(nxt, n_diag, diag_lo, full_lo, BLOCK_M), q_col, do_col, nxt < n_blocks, WS)
        last = (loads + n_blocks - 1) % STAGES
        dv = warpgroup_mma(p_op, do_smem.index(last), dv, is_async=True)
        dk = warpgroup_mma(ds_op, q_smem.index(last), dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=[dv, dk])
        _hand_back(empty, last, WS)
        return dk, dv

    @gluon.jit
    def _store_dkdv(dk, dv, DK, DV, seq_start, n0, head, seq_len, stride_dkm, stride_dkh, stride_dvm, stride_dvh,
                    dk_scale, dv_scale, BLOCK_N: gl.constexpr, DQK: gl.constexpr, DVD: gl.constexpr,
                    NUM_WARPS: gl.constexpr):
        dk_layout: gl.constexpr = mma_layout(NUM_WARPS, DQK)
        dv_layout: gl.constexpr = mma_layout(NUM_WARPS, DVD)
        rows_k = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dk_layout))
        cols_k = gl.arange(0, DQK, layout=gl.SliceLayout(0, dk_layout))
        rows_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dv_layout))
        cols_v = gl.arange(0, DVD, layout=gl.SliceLayout(0, dv_layout))
        k_rows = (seq_start + n0 + rows_k).to(gl.int64)
        gl.store(DK + k_rows[:, None] * stride_dkm + head * stride_dkh + cols_k[None, :],
                 (dk * dk_scale).to(DK.dtype.element_ty), mask=((n0 + rows_k) < seq_len)[:, None])
        v_rows = (seq_start + n0 + rows_v).to(gl.int64)
        gl.store(DV + v_rows[:, None] * stride_dvm + head * stride_dvh + cols_v[None, :],
                 (dv * dv_scale).to(DV.dtype.element_ty), mask=((n0 + rows_v) < seq_len)[:, None])

    @gluon.jit(do_not_specialize=["num_seqs", "num_heads"])
    def dkdv_kernel(
        q_desc, do_desc, k_desc, v_desc, ds_desc, DK, DV, SEQ_OFFSETS, NUM_TARGETS, COUNTER, DS_BASE,
        stride_dkm, stride_dkh, stride_dvm, stride_dvh, num_seqs, num_heads, half_alpha, dk_scale, dv_scale,
        HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        DQK: gl.constexpr, DVD: gl.constexpr, STAGES: gl.constexpr, STORE_DS: gl.constexpr,
    ):
        """``STORE_DS`` (32-query steps of 64-key tiles): every ``ds`` tile also goes to ``ds_desc``'s buffer,
        ``DS_BASE`` the first tile of each sequence (:mod:`gem_kernels.attention_stored`)."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        dtype: gl.constexpr = q_desc.dtype
        chunk_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, DQK], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, DVD], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DQK], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DVD], do_desc.layout)
        kv_bar, bars = _tile_barriers(STAGES)
        ds_smem = k_smem  # unused without STORE_DS
        if STORE_DS:
            ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], ds_desc.layout)

        loads = 0
        kv_phase = 0
        tile = gl.atomic_add(COUNTER, 1, sem="relaxed")
        tiles_before = tile * 0
        for chunk0 in range(0, num_seqs, CHUNK):
            tiles, tiles_end = _scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before,
                                           BLOCK_N, CHUNK, chunk_layout)
            chunk_end = tiles_before + gl.sum(tiles, 0)
            while tile < chunk_end:
                seq_start, seq_len, head, n0, history_len, diag_lo, full_lo, full_hi, n_diag, n_blocks, seq = (
                    _key_tile_of(tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS,
                                 HAS_TARGETS, BLOCK_M, BLOCK_N))
                next_tile = gl.atomic_add(COUNTER, 1, sem="relaxed")
                ds_head = seq.to(gl.int64) * 0
                if STORE_DS:
                    ds_head = _ds_head(DS_BASE, seq, head, seq_len)
                mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [seq_start + n0, head * DQK], kv_bar, k_smem)
                tma.async_copy_global_to_shared(v_desc, [seq_start + n0, head * DVD], kv_bar, v_smem)
                for i in gl.static_range(STAGES):
                    _load_pair(q_desc, do_desc, q_smem, do_smem, bars, (loads + i) % STAGES,
                               seq_start + _query_start(i, n_diag, diag_lo, full_lo, BLOCK_M), head * DQK,
                               head * DVD, i < n_blocks)
                mbarrier.wait(kv_bar, kv_phase)
                kv_phase ^= 1
                dk, dv = _dkdv_steps(k_smem, v_smem, q_smem, do_smem, bars, bars, loads, n_blocks, n_diag, diag_lo,
                                     full_lo, full_hi, n0, seq_len, history_len, half_alpha, q_desc, do_desc,
                                     seq_start, head * DQK, head * DVD, ds_smem, ds_desc, ds_head, BLOCK_M, BLOCK_N,
                                     DQK, DVD, STAGES, NUM_WARPS, False, STORE_DS)
                loads += n_blocks
                _store_dkdv(dk, dv, DK, DV, seq_start, n0, head, seq_len, stride_dkm, stride_dkh, stride_dvm,
                            stride_dvh, dk_scale, dv_scale, BLOCK_N, DQK, DVD, NUM_WARPS)
                tile = next_tile
            tiles_before = chunk_end
        if STORE_DS:
            tma.store_wait(0)
        _invalidate_tile_barriers(kv_bar, bars, STAGES)
        _release_queue(COUNTER)

    @gluon.jit
    def _dkdv_producer(q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty,
                       ready, empty, SEQ_OFFSETS, NUM_TARGETS, num_seqs, num_heads,
                       HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       DQK: gl.constexpr, DVD: gl.constexpr, STAGES: gl.constexpr):
        """The loads of the warp-specialized kernel: each tile's k and v into one of two slots, then its
        query blocks' q and g through the ring, each slot once its MMAs are done with it."""
        chunk_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        programs = gl.num_programs(0)
        tile = gl.program_id(0)
        tiles_before = tile * 0
        loads = 0
        done = 0
        for chunk0 in range(0, num_seqs, CHUNK):
            tiles, tiles_end = _scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before,
                                           BLOCK_N, CHUNK, chunk_layout)
            chunk_end = tiles_before + gl.sum(tiles, 0)
            while tile < chunk_end:
                seq_start, _len, head, n0, _hist, diag_lo, full_lo, _full, n_diag, n_blocks, _seq = _key_tile_of(
                    tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS, HAS_TARGETS,
                    BLOCK_M, BLOCK_N)
                kv = done % 2
                mbarrier.wait(kv_empty.index(kv), ((done // 2) & 1) ^ 1)
                bar = kv_ready.index(kv)
                mbarrier.expect(bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(k_desc, [seq_start + n0, head * DQK], bar, k_smem.index(kv))
                tma.async_copy_global_to_shared(v_desc, [seq_start + n0, head * DVD], bar, v_smem.index(kv))
                for i in range(n_blocks):
                    c = loads + i
                    mbarrier.wait(empty.index(c % STAGES), ((c // STAGES) & 1) ^ 1)
                    _load_pair(q_desc, do_desc, q_smem, do_smem, ready, c % STAGES,
                               seq_start + _query_start(i, n_diag, diag_lo, full_lo, BLOCK_M), head * DQK,
                               head * DVD, True)
                loads += n_blocks
                done += 1
                tile += programs
            tiles_before = chunk_end

    @gluon.jit
    def _dkdv_consumer(k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty, ready, empty, DK, DV, SEQ_OFFSETS,
                       NUM_TARGETS, stride_dkm, stride_dkh, stride_dvm, stride_dvh, num_seqs, num_heads, half_alpha,
                       dk_scale, dv_scale, HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, DQK: gl.constexpr, DVD: gl.constexpr, STAGES: gl.constexpr):
        NUM_WARPS: gl.constexpr = gl.num_warps()
        chunk_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        programs = gl.num_programs(0)
        tile = gl.program_id(0)
        tiles_before = tile * 0
        loads = 0
        done = 0
        for chunk0 in range(0, num_seqs, CHUNK):
            tiles, tiles_end = _scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before,
                                           BLOCK_N, CHUNK, chunk_layout)
            chunk_end = tiles_before + gl.sum(tiles, 0)
            while tile < chunk_end:
                seq_start, seq_len, head, n0, history_len, diag_lo, full_lo, full_hi, n_diag, n_blocks, _seq = (
                    _key_tile_of(tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS,
                                 HAS_TARGETS, BLOCK_M, BLOCK_N))
                kv = done % 2
                mbarrier.wait(kv_ready.index(kv), (done // 2) & 1)
                dk, dv = _dkdv_steps(k_smem.index(kv), v_smem.index(kv), q_smem, do_smem, ready, empty, loads,
                                     n_blocks, n_diag, diag_lo, full_lo, full_hi, n0, seq_len, history_len,
                                     half_alpha, None, None, seq_start, head * DQK, head * DVD, None, None, 0,
                                     BLOCK_M, BLOCK_N, DQK, DVD, STAGES, NUM_WARPS, True, False)
                mbarrier.arrive(kv_empty.index(kv), count=1)  # every MMA that read this k and v is done
                loads += n_blocks
                done += 1
                _store_dkdv(dk, dv, DK, DV, seq_start, n0, head, seq_len, stride_dkm, stride_dkh, stride_dvm,
                            stride_dvh, dk_scale, dv_scale, BLOCK_N, DQK, DVD, NUM_WARPS)
                tile += programs
            tiles_before = chunk_end

    @gluon.jit(do_not_specialize=["num_seqs", "num_heads"])
    def dkdv_ws_kernel(
        q_desc, do_desc, k_desc, v_desc, DK, DV, SEQ_OFFSETS, NUM_TARGETS,
        stride_dkm, stride_dkh, stride_dvm, stride_dvh, num_seqs, num_heads, half_alpha, dk_scale, dv_scale,
        HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        DQK: gl.constexpr, DVD: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        """:func:`dkdv_kernel` with its loads in a producer warp (``warp_specialize``); two k/v slots, so
        the next tile's keys load while this one runs; tiles dealt statically to both partitions."""
        dtype: gl.constexpr = q_desc.dtype
        k_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, DQK], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, DVD], v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DQK], q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, DVD], do_desc.layout)
        kv_ready, kv_empty, ready, empty = _ws_barriers(STAGES)
        gl.warp_specialize(
            [
                (_dkdv_consumer, (k_smem, v_smem, q_smem, do_smem, kv_ready, kv_empty, ready, empty, DK, DV,
                                  SEQ_OFFSETS, NUM_TARGETS, stride_dkm, stride_dkh, stride_dvm, stride_dvh, num_seqs,
                                  num_heads, half_alpha, dk_scale, dv_scale, HAS_TARGETS, CHUNK, BLOCK_M, BLOCK_N,
                                  DQK, DVD, STAGES)),
                (_dkdv_producer, (q_desc, do_desc, k_desc, v_desc, k_smem, v_smem, q_smem, do_smem, kv_ready,
                                  kv_empty, ready, empty, SEQ_OFFSETS, NUM_TARGETS, num_seqs, num_heads, HAS_TARGETS,
                                  CHUNK, BLOCK_M, BLOCK_N, DQK, DVD, STAGES)),
            ],
            [1],
            [PRODUCER_REGS],
        )
        _invalidate_ws_barriers(kv_ready, kv_empty, ready, empty, STAGES)
