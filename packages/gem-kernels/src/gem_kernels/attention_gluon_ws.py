"""The Gluon Hopper forward with its loads in a warp of their own (``ws_*`` configs of
:mod:`gem_kernels.attention_gluon`).

:mod:`~gem_kernels.attention_gluon`'s kernel issues its TMA loads from the warps that do the math, and
the compiler puts CTA barriers (``bar.sync``) around each issue (3 an iteration in the sm_90 build, plus
one before the ring's wait), which holds the two warpgroups in step. Here, FlashAttention-3's way, a
producer warp (``warp_specialize``, few registers) walks the same tiles and keeps the ring full; the
consumer warps wait only on mbarriers:

* ``q_ready[t]`` / ``q_empty[t]``: query slot ``t`` (tiles alternate between two, so the next tile's
  queries load during this one) loaded / every MMA that read it retired;
* ``kv_ready[s]`` / ``kv_empty[s]``: slot ``s``'s key and value tiles loaded / both read.

The producer waits on ``*_empty`` with the opposite parity, so its first pass over each slot does not
wait. Tiles are dealt statically (program ``p`` takes ``p, p + P, p + 2P ...`` of the queue's order:
sequence, head, block) so that both partitions know them without talking; the consumer's math and
mask are :mod:`~gem_kernels.attention_gluon`'s.
"""

from __future__ import annotations

from gem_kernels.attention_gluon_common import HAVE_GLUON

if HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
    )

    from gem_kernels.attention_gluon_common import (
        _block_start,
        _invalidate_ws_barriers,
        _load_pair,
        _scan_chunk,
        _store_rows,
        _tile_of,
        _ws_barriers,
    )
    from gem_kernels.attention_gluon_fwd import _forward_steps

    @gluon.jit
    def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, kv_ready,
                  kv_empty, SEQ_OFFSETS, NUM_TARGETS, num_seqs, num_heads,
                  HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  DQK: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr, WITH_GRAD: gl.constexpr):
        """The loads of a query-major kernel's producer warp: per tile its queries (and with ``WITH_GRAD``
        the output gradient's rows: the dq pass) into one of two slots, then its key blocks' k and v
        through the ring, each slot once the consumer has handed it back."""
        chunk_layout: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
        programs = gl.num_programs(0)
        tile = gl.program_id(0)
        tiles_before = tile * 0
        loads = 0
        done = 0
        for chunk0 in range(0, num_seqs, CHUNK):
            tiles, tiles_end = _scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before,
                                           BLOCK_M, CHUNK, chunk_layout)
            chunk_end = tiles_before + gl.sum(tiles, 0)
            while tile < chunk_end:
                seq_start, _len, head, m0, _hist, _full, n_hist, diag_lo, n_blocks = _tile_of(
                    tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS, HAS_TARGETS,
                    BLOCK_M, BLOCK_N)
                # two query slots: this tile's q loads while the consumer works on the previous tile
                q_slot = done % 2
                mbarrier.wait(q_empty.index(q_slot), ((done // 2) & 1) ^ 1)
                bar = q_ready.index(q_slot)
                if WITH_GRAD:
                    mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(do_desc, [seq_start + m0, head * DV], bar, do_smem.index(q_slot))
                else:
                    mbarrier.expect(bar, q_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(q_desc, [seq_start + m0, head * DQK], bar, q_smem.index(q_slot))
                for i in range(n_blocks):
                    c = loads + i
                    mbarrier.wait(kv_empty.index(c % STAGES), ((c // STAGES) & 1) ^ 1)
                    _load_pair(k_desc, v_desc, k_smem, v_smem, kv_ready, c % STAGES,
                               seq_start + _block_start(i, n_hist, diag_lo, BLOCK_N), head * DQK, head * DV, True)
                loads += n_blocks
                done += 1
                tile += programs
            tiles_before = chunk_end

    @gluon.jit
    def _consumer(q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, OUT,
                  SEQ_OFFSETS, NUM_TARGETS, stride_om, stride_oh, num_seqs, num_heads, half_alpha, out_scale,
                  HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  DQK: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr, STEPS: gl.constexpr,
                  WITH_GRAD: gl.constexpr):
        """The math of a query-major kernel's consumer warps: per tile, once :func:`_producer` has loaded its
        queries, ``STEPS`` over its key blocks (the forward's ``_forward_steps``; with ``WITH_GRAD`` the dq
        pass's ``_dq_steps``, which also reads the output gradient's rows), its query slot handed back, and
        the result (``DV`` wide, ``DQK`` with ``WITH_GRAD``) into ``OUT``."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        D_OUT: gl.constexpr = DQK if WITH_GRAD else DV
        chunk_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        programs = gl.num_programs(0)
        tile = gl.program_id(0)
        tiles_before = tile * 0
        loads = 0
        done = 0
        for chunk0 in range(0, num_seqs, CHUNK):
            tiles, tiles_end = _scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before,
                                           BLOCK_M, CHUNK, chunk_layout)
            chunk_end = tiles_before + gl.sum(tiles, 0)
            while tile < chunk_end:
                seq_start, seq_len, head, m0, history_len, full_hi, n_hist, diag_lo, n_blocks = _tile_of(
                    tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, NUM_TARGETS, HAS_TARGETS,
                    BLOCK_M, BLOCK_N)
                q_slot = done % 2
                mbarrier.wait(q_ready.index(q_slot), (done // 2) & 1)
                if WITH_GRAD:
                    acc = STEPS(q_smem.index(q_slot), do_smem.index(q_slot), k_smem, v_smem, kv_ready, kv_empty,
                                loads, n_blocks, n_hist, diag_lo, full_hi, m0, seq_len, history_len, half_alpha, None,
                                None, seq_start, head * DQK, head * DV, BLOCK_M, BLOCK_N, DQK, STAGES, NUM_WARPS, True)
                else:
                    acc = STEPS(q_smem.index(q_slot), k_smem, v_smem, kv_ready, kv_empty, loads, n_blocks, n_hist,
                                diag_lo, full_hi, m0, seq_len, history_len, half_alpha, None, None, seq_start,
                                head * DQK, head * DV, BLOCK_M, BLOCK_N, DV, STAGES, NUM_WARPS, True)
                mbarrier.arrive(q_empty.index(q_slot), count=1)  # every MMA that read this q (and g) is done
                loads += n_blocks
                done += 1
                _store_rows(acc, OUT, seq_start, m0, head, seq_len, stride_om, stride_oh, out_scale, BLOCK_M, D_OUT,
                            NUM_WARPS)
                tile += programs
            tiles_before = chunk_end

    @gluon.jit
    def _query_major_ws(q_desc, do_desc, k_desc, v_desc, OUT, SEQ_OFFSETS, NUM_TARGETS,
                        stride_om, stride_oh, num_seqs, num_heads, half_alpha, out_scale,
                        HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        DQK: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                        STEPS: gl.constexpr, WITH_GRAD: gl.constexpr):
        """A query-major kernel's program with its loads in a producer warp: two query slots (and with
        ``WITH_GRAD`` two of the output gradient's rows), the ring's ``STAGES`` key and value slots, their
        barriers, and the two partitions, :func:`_consumer` (with ``STEPS``) and :func:`_producer`."""
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, DQK], q_desc.layout)
        if WITH_GRAD:
            do_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, DV], do_desc.layout)
        else:
            do_smem: gl.constexpr = None
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DQK], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], v_desc.layout)
        q_ready, q_empty, kv_ready, kv_empty = _ws_barriers(STAGES)
        gl.warp_specialize(
            [
                (_consumer, (q_smem, do_smem, k_smem, v_smem, q_ready, q_empty, kv_ready, kv_empty, OUT, SEQ_OFFSETS,
                             NUM_TARGETS, stride_om, stride_oh, num_seqs, num_heads, half_alpha, out_scale,
                             HAS_TARGETS, CHUNK, BLOCK_M, BLOCK_N, DQK, DV, STAGES, STEPS, WITH_GRAD)),
                (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, q_ready, q_empty,
                             kv_ready, kv_empty, SEQ_OFFSETS, NUM_TARGETS, num_seqs, num_heads, HAS_TARGETS, CHUNK,
                             BLOCK_M, BLOCK_N, DQK, DV, STAGES, WITH_GRAD)),
            ],
            [1],
            [PRODUCER_REGS],
        )
        _invalidate_ws_barriers(q_ready, q_empty, kv_ready, kv_empty, STAGES)

    @gluon.jit(do_not_specialize=["num_seqs", "num_heads"])
    def forward_ws_kernel(
        q_desc, k_desc, v_desc, OUT, SEQ_OFFSETS, NUM_TARGETS,
        stride_om, stride_oh, num_seqs, num_heads, half_alpha, out_scale,
        HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        DQK: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
    ):
        _query_major_ws(q_desc, None, k_desc, v_desc, OUT, SEQ_OFFSETS, NUM_TARGETS, stride_om, stride_oh, num_seqs,
                        num_heads, half_alpha, out_scale, HAS_TARGETS, CHUNK, BLOCK_M, BLOCK_N, DQK, DV, STAGES,
                        PRODUCER_REGS, _forward_steps, False)
