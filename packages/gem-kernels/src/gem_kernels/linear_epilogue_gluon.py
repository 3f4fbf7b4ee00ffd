"""The HSTU block's two GEMMs with their epilogues, in Gluon for Hopper (sm_90): the same contract as
:mod:`gem_kernels.linear_epilogue_triton` (``linear_silu``, ``linear_residual``), with the schedule that
kernel cannot get from Triton.

The Triton kernel waits for each tile's stores before the next tile's first loads, and loads the
residual only when the accumulator is done: with ``K = 1,024`` a tile's MMAs take ~11 us on an H200 and
its epilogue's memory traffic a few more, so the tensor cores idle through every epilogue (the Triton
GEMM ran 627 TFLOP/s to cuBLAS's 706 on uvqk's shape, 2026-12-05). Here, per program (persistent, one an
SM, tiles in grouped order):

- one TMA ring of ``STAGES`` ``(x, w)`` K-steps runs across tile boundaries, so the next tile's first
  operands arrive while this tile's epilogue runs;
- ``wgmma`` is asynchronous with one group in flight: the slot of step ``c - 1`` is refilled as soon
  as step ``c`` is issued;
- the residual tile is requested by TMA when its tile starts and is in shared memory by the epilogue;
- ``pre`` (and ``post``) go out by asynchronous TMA stores that drain during the next tile's MMAs; a
  store buffer is waited for only when the next epilogue rewrites it.

``post`` is ``silu`` of ``pre`` as stored, by the formula of :func:`gem_kernels.hstu_gap_triton.silu_columns`.

Whether it beats cuBLAS and the passes is for ``benchmarks/linear_epilogue.py`` (``--gluon-configs``) on
the device to say. Gluon does not run in Triton's interpreter: on the CPU the tests compile it for sm_90
(:func:`compile_report`), and the benchmark checks it against cuBLAS before it times it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gem_kernels.attention_gluon_common import HAVE_GLUON


@dataclass(frozen=True)
class GluonGemmConfig:
    """The output tile, the K step, the ring's depth and the warps (two warpgroups split the rows)."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int = 8
    group_m: int = 8
    ws: bool = False
    """Warp-specialized: one producer warp issues the loads, the other warps run the MMAs and the
    epilogue (no CTA barrier in their loop)."""
    split: int = 1
    """(``ws``) The tile's columns as ``split`` accumulators of ``block_n / split``, each stored on its own."""
    pingpong: bool = False
    """(``ws``) Two consumer warpgroups of ``warps`` (4) warps, a ``[block_m, block_n]`` tile each, in turn."""
    store_buffers: int = 2
    """(``ws``) Shared buffers of ``[block_m, block_n / split]`` that the TMA stores go out of, in turn."""


CONFIGS: dict[str, GluonGemmConfig] = {
    "g128n128s4": GluonGemmConfig(128, 128, 64, 4),
    "g128n128s5": GluonGemmConfig(128, 128, 64, 5),
    "g128n128k128s2": GluonGemmConfig(128, 128, 128, 2),
    "g128n256s2": GluonGemmConfig(128, 256, 64, 2),
    "g128n256k32s4": GluonGemmConfig(128, 256, 32, 4),
    "g256n128s2": GluonGemmConfig(256, 128, 64, 2),
    "ws128n256s3": GluonGemmConfig(128, 256, 64, 3, ws=True, split=2),
    "ws128n256s4": GluonGemmConfig(128, 256, 64, 4, ws=True, split=2, store_buffers=1),
    "ws128n256k32s6": GluonGemmConfig(128, 256, 32, 6, ws=True, split=2),
    "ws128n256k32s7": GluonGemmConfig(128, 256, 32, 7, ws=True, split=2, store_buffers=1),
    "ws128n256k32s8": GluonGemmConfig(128, 256, 32, 8, ws=True, split=2, store_buffers=1),
    "ws128n128s4": GluonGemmConfig(128, 128, 64, 4, ws=True),
    "ws128n128s5": GluonGemmConfig(128, 128, 64, 5, ws=True, store_buffers=1),
    "pp128n128s4": GluonGemmConfig(128, 128, 64, 4, warps=4, ws=True, pingpong=True, store_buffers=1),
    "pp128n128s3": GluonGemmConfig(128, 128, 64, 3, warps=4, ws=True, pingpong=True, store_buffers=2),
    "pp128n128s5": GluonGemmConfig(128, 128, 64, 5, warps=4, ws=True, pingpong=True, store_buffers=1),
}
"""The candidates: shared memory holds the ring and one ``[block_m, block_n]`` buffer per stored or
loaded epilogue tile (two of them), within the 227 KiB an SM gives one program."""
DEFAULT_CONFIG = "g128n128s4"

PRODUCER_REGISTERS = 40
"""Registers of the ``ws`` configs' producer warp."""
CONSUMER_REGISTERS = 232
"""Registers of the ping-pong configs' second consumer warpgroup."""

SILU, RESIDUAL = 1, 2
"""The epilogues, as in :mod:`gem_kernels.linear_epilogue_triton`."""


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

    from gem_kernels.attention_gluon_common import _init_barriers, _invalidate_barriers

    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # Triton 3.7's name, and 3.6's

    @gluon.jit
    def _tile_coords(tile, num_m, num_n, GROUP_M: gl.constexpr):
        """Grouped order: ``GROUP_M`` row tiles share each column sweep, so the weight's tiles stay in L2."""
        per_group = GROUP_M * num_n
        first_m = tile // per_group * GROUP_M
        rows_in_group = gl.minimum(num_m - first_m, GROUP_M)
        return first_m + (tile % per_group) % rows_in_group, (tile % per_group) // rows_in_group

    @gluon.jit
    def _load_step(step, x_desc, w_desc, x_bufs, w_bufs, ready, total, first, stride, num_m, num_n, k_tiles,
                   STAGES: gl.constexpr, GROUP_M: gl.constexpr):  # fmt: skip
        """Request this program's K-step ``step`` (its tile ``step // k_tiles``) into ring slot ``step % STAGES``."""
        slot = step % STAGES
        pred = step < total
        pid_m, pid_n = _tile_coords(first + (step // k_tiles) * stride, num_m, num_n, GROUP_M)
        k = (step % k_tiles) * x_desc.block_type.shape[1]
        bar = ready.index(slot)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(x_desc, [pid_m * x_desc.block_type.shape[0], k], bar, x_bufs.index(slot), pred)
        tma.async_copy_global_to_shared(w_desc, [pid_n * w_desc.block_type.shape[0], k], bar, w_bufs.index(slot), pred)

    @gluon.jit
    def _gemm_epilogue_kernel(x_desc, w_desc, out_desc, extra_desc, BIAS, M, N, SILU_FROM,
                              HAS_BIAS: gl.constexpr, EPILOGUE: gl.constexpr, STAGES: gl.constexpr,
                              GROUP_M: gl.constexpr, num_warps: gl.constexpr):  # fmt: skip
        """``OUT = X @ W^T (+ BIAS)``, then by ``EPILOGUE``: 0 nothing more; 1: ``EXTRA = silu(OUT[:, SILU_FROM:])``
        (``SILU_FROM`` a multiple of the tile width); 2: ``OUT = EXTRA + X @ W^T (+ BIAS)``, rounded once."""
        BLOCK_M: gl.constexpr = out_desc.block_type.shape[0]
        BLOCK_N: gl.constexpr = out_desc.block_type.shape[1]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        dtype: gl.constexpr = x_desc.dtype
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        K = x_desc.shape[1]
        k_tiles = gl.cdiv(K, BLOCK_K)
        num_m = gl.cdiv(M, BLOCK_M)
        num_n = gl.cdiv(N, BLOCK_N)
        first = gl.program_id(0)
        stride = gl.num_programs(0)
        my_tiles = gl.cdiv(num_m * num_n - first, stride)
        total = my_tiles * k_tiles

        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        out_smem = gl.allocate_shared_memory(dtype, out_desc.block_type.shape, out_desc.layout)
        extra_smem = gl.allocate_shared_memory(dtype, extra_desc.block_type.shape, extra_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        extra_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        _init_barriers(ready, STAGES)
        mbarrier.init(extra_bar, count=1)
        fence_async_shared()

        for step in gl.static_range(STAGES - 1):  # the ring's first steps
            _load_step(step, x_desc, w_desc, x_bufs, w_bufs, ready, total, first, stride, num_m, num_n, k_tiles,
                       STAGES, GROUP_M)  # fmt: skip
        consumed = 0
        for t in range(my_tiles):
            pid_m, pid_n = _tile_coords(first + t * stride, num_m, num_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            if EPILOGUE == 2:  # the residual tile, in shared memory by the epilogue
                _cta_barrier()  # every warp has read the last tile's
                mbarrier.expect(extra_bar, extra_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(extra_desc, [off_m, off_n], extra_bar, extra_smem)
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            for _ in range(k_tiles):
                slot = consumed % STAGES
                mbarrier.wait(ready.index(slot), (consumed // STAGES) & 1)
                acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])  # step consumed - 1 is done: refill its slot
                _load_step(consumed + STAGES - 1, x_desc, w_desc, x_bufs, w_bufs, ready, total, first, stride,
                           num_m, num_n, k_tiles, STAGES, GROUP_M)  # fmt: skip
                consumed += 1
            acc = warpgroup_mma_wait(0, deps=[acc])

            if HAS_BIAS:
                cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
                acc = acc + gl.load(BIAS + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
            if EPILOGUE == 2:
                mbarrier.wait(extra_bar, t & 1)
                acc = acc + extra_smem.load(acc_layout).to(gl.float32)
            out = acc.to(dtype)
            tma.store_wait(pendings=0)  # the last tile's stores have left the buffers
            _cta_barrier()
            out_smem.store(out)
            if EPILOGUE == 1:
                if off_n >= SILU_FROM:
                    z = out.to(gl.float32)
                    extra_smem.store((z * (1.0 / (1.0 + gl.exp(-z)))).to(dtype))
            fence_async_shared()
            _cta_barrier()
            tma.async_copy_shared_to_global(out_desc, [off_m, off_n], out_smem)
            if EPILOGUE == 1:
                if off_n >= SILU_FROM:
                    tma.async_copy_shared_to_global(extra_desc, [off_m, off_n - SILU_FROM], extra_smem)
        tma.store_wait(pendings=0)
        _invalidate_barriers(ready, STAGES)
        mbarrier.invalidate(extra_bar)


    @gluon.jit
    def _ws_producer(x_desc, w_desc, extra_desc, x_bufs, w_bufs, res_bufs, ready, empty, res_ready, res_empty, M, N,
                     EPILOGUE: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     SPLIT: gl.constexpr):  # fmt: skip
        """The loads: each K-step into the ring once its slot is handed back, and a residual tile (in
        ``SPLIT`` pieces) once the last one is read, a few steps into its tile."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        PIECE: gl.constexpr = BLOCK_N // SPLIT
        k_tiles = gl.cdiv(x_desc.shape[1], BLOCK_K)
        num_m = gl.cdiv(M, BLOCK_M)
        num_n = gl.cdiv(N, BLOCK_N)
        first = gl.program_id(0)
        stride = gl.num_programs(0)
        residual_at = gl.minimum(k_tiles - 1, STAGES - 1)
        step = 0
        for t in range(gl.cdiv(num_m * num_n - first, stride)):
            pid_m, pid_n = _tile_coords(first + t * stride, num_m, num_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            for ki in range(k_tiles):
                slot = step % STAGES
                mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(x_desc, [off_m, ki * BLOCK_K], bar, x_bufs.index(slot))
                tma.async_copy_global_to_shared(w_desc, [off_n, ki * BLOCK_K], bar, w_bufs.index(slot))
                step += 1
                if EPILOGUE == 2:
                    if ki == residual_at:
                        mbarrier.wait(res_empty, (t & 1) ^ 1)
                        mbarrier.expect(res_ready, SPLIT * extra_desc.block_type.nbytes)
                        for h in gl.static_range(SPLIT):
                            tma.async_copy_global_to_shared(extra_desc, [off_m, off_n + h * PIECE], res_ready,
                                                            res_bufs.index(h))  # fmt: skip

    @gluon.jit
    def _ws_put(value, desc, row, col, bufs, stores, NBUF: gl.constexpr):
        """``value`` out through store buffer ``stores % NBUF`` by an asynchronous TMA store, once the
        store that last used that buffer has read it."""
        buf = bufs.index(stores % NBUF)
        tma.store_wait(pendings=NBUF - 1)
        _cta_barrier()
        buf.store(value)
        fence_async_shared()
        _cta_barrier()
        tma.async_copy_shared_to_global(desc, [row, col], buf)
        return stores + 1

    @gluon.jit
    def _ws_finish(acc, col0, off_m, stores, out_bufs, out_desc, extra_desc, BIAS, N, SILU_FROM,
                   HAS_BIAS: gl.constexpr, EPILOGUE: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
        """One accumulator's epilogue (columns ``col0 ..``, its residual already added): bias, the stores."""
        if HAS_BIAS:
            cols = col0 + gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, acc.type.layout))
            acc = acc + gl.load(BIAS + cols, mask=cols < N, other=0.0).to(gl.float32)[None, :]
        out = acc.to(out_desc.dtype)
        stores = _ws_put(out, out_desc, off_m, col0, out_bufs, stores, NBUF)
        if EPILOGUE == 1:
            if col0 >= SILU_FROM:
                z = out.to(gl.float32)
                post = (z * (1.0 / (1.0 + gl.exp(-z)))).to(out_desc.dtype)
                stores = _ws_put(post, extra_desc, off_m, col0 - SILU_FROM, out_bufs, stores, NBUF)
        return stores

    @gluon.jit
    def _ws_consumer(x_bufs, w_bufs, res_bufs, out_bufs, ready, empty, res_ready, res_empty, out_desc, extra_desc,
                     BIAS, M, N, K, SILU_FROM, HAS_BIAS: gl.constexpr, EPILOGUE: gl.constexpr, STAGES: gl.constexpr,
                     GROUP_M: gl.constexpr, BLOCK_N: gl.constexpr, SPLIT: gl.constexpr, NBUF: gl.constexpr):  # fmt: skip
        """The MMAs (``SPLIT`` accumulators of ``BLOCK_N / SPLIT`` columns, one group of ``wgmma`` in
        flight), each ring slot handed back once read, and the epilogue."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        BLOCK_M: gl.constexpr = x_bufs.shape[1]
        BLOCK_K: gl.constexpr = x_bufs.shape[2]
        PIECE: gl.constexpr = BLOCK_N // SPLIT
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, PIECE, 16])  # fmt: skip
        k_tiles = gl.cdiv(K, BLOCK_K)
        num_m = gl.cdiv(M, BLOCK_M)
        num_n = gl.cdiv(N, BLOCK_N)
        first = gl.program_id(0)
        stride = gl.num_programs(0)
        step = 0
        stores = 0
        for t in range(gl.cdiv(num_m * num_n - first, stride)):
            pid_m, pid_n = _tile_coords(first + t * stride, num_m, num_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            acc0 = gl.zeros([BLOCK_M, PIECE], gl.float32, acc_layout)
            acc1 = gl.zeros([BLOCK_M, PIECE], gl.float32, acc_layout)
            for ki in range(k_tiles):
                slot = step % STAGES
                mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                if SPLIT == 1:
                    acc0 = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc0, is_async=True)
                    acc0 = warpgroup_mma_wait(1, deps=[acc0])
                else:
                    w_tile = w_bufs.index(slot)
                    acc0 = warpgroup_mma(x_bufs.index(slot), w_tile.slice(0, PIECE).permute((1, 0)), acc0,
                                         is_async=True)  # fmt: skip
                    acc1 = warpgroup_mma(x_bufs.index(slot), w_tile.slice(PIECE, PIECE).permute((1, 0)), acc1,
                                         is_async=True)  # fmt: skip
                    acc0, acc1 = warpgroup_mma_wait(2, deps=[acc0, acc1])
                if ki > 0:  # the last step's MMAs are done, in both warpgroups: its slot goes back
                    _cta_barrier()
                    mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
                step += 1
            if SPLIT == 1:
                acc0 = warpgroup_mma_wait(0, deps=[acc0])
            else:
                acc0, acc1 = warpgroup_mma_wait(0, deps=[acc0, acc1])
            _cta_barrier()
            mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
            if EPILOGUE == 2:
                mbarrier.wait(res_ready, t & 1)
                acc0 = acc0 + res_bufs.index(0).load(acc_layout).to(gl.float32)
            stores = _ws_finish(acc0, off_n, off_m, stores, out_bufs, out_desc, extra_desc, BIAS, N, SILU_FROM,
                                HAS_BIAS, EPILOGUE, NBUF)  # fmt: skip
            if SPLIT == 2:
                if EPILOGUE == 2:
                    acc1 = acc1 + res_bufs.index(SPLIT - 1).load(acc_layout).to(gl.float32)
                stores = _ws_finish(acc1, off_n + PIECE, off_m, stores, out_bufs, out_desc, extra_desc, BIAS, N,
                                    SILU_FROM, HAS_BIAS, EPILOGUE, NBUF)  # fmt: skip
            if EPILOGUE == 2:
                _cta_barrier()
                mbarrier.arrive(res_empty, count=1)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gemm_ws_kernel(x_desc, w_desc, out_desc, extra_desc, BIAS, M, N, SILU_FROM, HAS_BIAS: gl.constexpr,
                        EPILOGUE: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, BLOCK_N: gl.constexpr,
                        SPLIT: gl.constexpr, NBUF: gl.constexpr, RES_ROWS: gl.constexpr,
                        PRODUCER_REGS: gl.constexpr):  # fmt: skip
        """:func:`_gemm_epilogue_kernel`'s contract, warp-specialized: ``OUT`` and ``EXTRA`` in
        ``[BLOCK_M, BLOCK_N / SPLIT]`` pieces (their descriptors' blocks); ``RES_ROWS`` the residual
        buffers' rows (``BLOCK_M`` with the residual, else a token 8)."""
        dtype: gl.constexpr = x_desc.dtype
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        PIECE: gl.constexpr = BLOCK_N // SPLIT
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        out_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_M, PIECE], out_desc.layout)
        res_bufs = gl.allocate_shared_memory(dtype, [SPLIT, RES_ROWS, PIECE], extra_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        res_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        res_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        _init_barriers(ready, STAGES)
        _init_barriers(empty, STAGES)
        mbarrier.init(res_ready, count=1)
        mbarrier.init(res_empty, count=1)
        fence_async_shared()
        gl.warp_specialize(
            [
                (_ws_consumer, (x_bufs, w_bufs, res_bufs, out_bufs, ready, empty, res_ready, res_empty, out_desc,
                                extra_desc, BIAS, M, N, x_desc.shape[1], SILU_FROM, HAS_BIAS, EPILOGUE, STAGES,
                                GROUP_M, BLOCK_N, SPLIT, NBUF)),
                (_ws_producer, (x_desc, w_desc, extra_desc, x_bufs, w_bufs, res_bufs, ready, empty, res_ready,
                                res_empty, M, N, EPILOGUE, STAGES, GROUP_M, BLOCK_N, SPLIT)),
            ],
            [1],
            [PRODUCER_REGS],
        )  # fmt: skip
        _invalidate_barriers(ready, STAGES)
        _invalidate_barriers(empty, STAGES)
        mbarrier.invalidate(res_ready)
        mbarrier.invalidate(res_empty)


    @gluon.jit
    def _pp_consumer(x_bufs, w_bufs, out_bufs, ready, empty, res_bar, turns, out_desc, extra_desc, BIAS, M, N, K,
                     SILU_FROM,
                     HAS_BIAS: gl.constexpr, EPILOGUE: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                     NBUF: gl.constexpr, ROLE: gl.constexpr):  # fmt: skip
        """One of the two consumer warpgroups of the ping-pong kernel: this program's tiles ``ROLE``,
        ``ROLE + 2``, ...; its epilogue runs while the other warpgroup's MMAs do (the ring hands the
        tensor cores to each in turn). The two take turns at their main loops (barriers ``turns``: this
        one waits on its own and hands the next turn to the other once its last MMA is issued), so a
        warpgroup never waits on a ring slot's barrier more than one fill ahead of the one in flight.
        The residual tile comes by TMA into the store buffer that the epilogue then writes the sum into,
        requested when the tile starts."""
        NUM_WARPS: gl.constexpr = gl.num_warps()
        BLOCK_M: gl.constexpr = x_bufs.shape[1]
        BLOCK_K: gl.constexpr = x_bufs.shape[2]
        BLOCK_N: gl.constexpr = w_bufs.shape[1]
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                             instr_shape=[16, BLOCK_N, 16])  # fmt: skip
        k_tiles = gl.cdiv(K, BLOCK_K)
        num_m = gl.cdiv(M, BLOCK_M)
        num_n = gl.cdiv(N, BLOCK_N)
        first = gl.program_id(0)
        stride = gl.num_programs(0)
        stores = 0
        for t in range(ROLE, gl.cdiv(num_m * num_n - first, stride), 2):
            pid_m, pid_n = _tile_coords(first + t * stride, num_m, num_n, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            if EPILOGUE == 2:
                tma.store_wait(pendings=NBUF - 1)  # the buffer's last store has read it
                _cta_barrier()
                mbarrier.expect(res_bar, extra_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(extra_desc, [off_m, off_n], res_bar, out_bufs.index(stores % NBUF))
            acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, acc_layout)
            step = t * k_tiles
            turn = (t - ROLE) // 2
            mbarrier.wait(turns.index(ROLE), (turn & 1) ^ (1 - ROLE))
            for ki in range(k_tiles):
                slot = step % STAGES
                mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                acc = warpgroup_mma(x_bufs.index(slot), w_bufs.index(slot).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                if ki > 0:
                    _cta_barrier()
                    mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
                step += 1
            mbarrier.arrive(turns.index(1 - ROLE), count=1)
            acc = warpgroup_mma_wait(0, deps=[acc])
            _cta_barrier()
            mbarrier.arrive(empty.index((step - 1) % STAGES), count=1)
            if EPILOGUE == 2:
                mbarrier.wait(res_bar, ((t - ROLE) // 2) & 1)
                acc = acc + out_bufs.index(stores % NBUF).load(acc_layout).to(gl.float32)
            stores = _ws_finish(acc, off_n, off_m, stores, out_bufs, out_desc, extra_desc, BIAS, N, SILU_FROM,
                                HAS_BIAS, EPILOGUE, NBUF)  # fmt: skip
        tma.store_wait(pendings=0)

    @gluon.jit
    def _gemm_pp_kernel(x_desc, w_desc, out_desc, extra_desc, BIAS, M, N, SILU_FROM, HAS_BIAS: gl.constexpr,
                        EPILOGUE: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, NBUF: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):  # fmt: skip
        """:func:`_gemm_epilogue_kernel`'s contract with two consumer warpgroups in ping-pong (CUTLASS's
        schedule): one producer warp, a warpgroup per tile."""
        dtype: gl.constexpr = x_desc.dtype
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
        x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
        out_a = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_M, BLOCK_N], out_desc.layout)
        out_b = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_M, BLOCK_N], out_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        res_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        _init_barriers(ready, STAGES)
        _init_barriers(empty, STAGES)
        _init_barriers(res_bars, 2)
        _init_barriers(turns, 2)
        fence_async_shared()
        gl.warp_specialize(
            [
                (_pp_consumer, (x_bufs, w_bufs, out_a, ready, empty, res_bars.index(0), turns, out_desc, extra_desc, BIAS,
                                M, N, x_desc.shape[1], SILU_FROM, HAS_BIAS, EPILOGUE, STAGES, GROUP_M, NBUF, 0)),
                (_pp_consumer, (x_bufs, w_bufs, out_b, ready, empty, res_bars.index(1), turns, out_desc, extra_desc, BIAS,
                                M, N, x_desc.shape[1], SILU_FROM, HAS_BIAS, EPILOGUE, STAGES, GROUP_M, NBUF, 1)),
                (_ws_producer, (x_desc, w_desc, extra_desc, x_bufs, w_bufs, x_bufs, ready, empty, ready.index(0),
                                empty.index(0), M, N, 0, STAGES, GROUP_M, BLOCK_N, 1)),
            ],
            [4, 1],
            [CONSUMER_REGS, PRODUCER_REGS],
        )  # fmt: skip
        _invalidate_barriers(ready, STAGES)
        _invalidate_barriers(empty, STAGES)
        _invalidate_barriers(res_bars, 2)
        _invalidate_barriers(turns, 2)


def _descriptor(t: torch.Tensor, block: list[int]) -> Any:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from gem_kernels.attention_gluon import shared_layout

    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], block, shared_layout(block, t.dtype))


def supported(x: torch.Tensor, weight: torch.Tensor, silu_from: int, config: str = DEFAULT_CONFIG) -> bool:
    """Whether these kernels take this GEMM on its device: a Hopper GPU with Gluon, one 16-bit dtype,
    16-byte rows, ``silu_from`` a multiple of the tile width."""
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) != (9, 0) or not HAVE_GLUON:
        return False
    tiles = _config(config)
    return (x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
            and weight.dim() == 2 and x.shape[1] == weight.shape[1] and (x.shape[1] * x.element_size()) % 16 == 0
            and silu_from % tiles.block_n == 0)  # fmt: skip


def _config(name: str) -> GluonGemmConfig:
    if name not in CONFIGS:
        raise ValueError(f"linear_epilogue_gluon: config {name!r} is not one of {sorted(CONFIGS)}")
    return CONFIGS[name]


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, extra: torch.Tensor,
            silu_from: int, epilogue: int, config: str) -> None:  # fmt: skip
    from gem_kernels.attention_triton_common import device_guard, num_programs

    tiles = _config(config)
    m, n = out.shape
    if m == 0:
        return
    piece = tiles.block_n // tiles.split if tiles.ws and not tiles.pingpong else tiles.block_n
    x_desc = _descriptor(x, [tiles.block_m, tiles.block_k])
    w_desc = _descriptor(weight, [tiles.block_n, tiles.block_k])
    out_desc = _descriptor(out, [tiles.block_m, piece])
    extra_desc = _descriptor(extra if extra.numel() else out, [tiles.block_m, piece])
    num_tiles = -(-m // tiles.block_m) * -(-n // tiles.block_n)
    grid = (num_programs(x.device, 1, num_tiles),)
    common = (x_desc, w_desc, out_desc, extra_desc, bias if bias is not None else x, m, n, silu_from)
    with device_guard(x.device):
        if tiles.pingpong:
            _gemm_pp_kernel[grid](
                *common,
                HAS_BIAS=bias is not None, EPILOGUE=epilogue, STAGES=tiles.stages, GROUP_M=tiles.group_m,
                NBUF=tiles.store_buffers, CONSUMER_REGS=CONSUMER_REGISTERS, PRODUCER_REGS=PRODUCER_REGISTERS,
                num_warps=tiles.warps,
            )  # fmt: skip
        elif tiles.ws:
            _gemm_ws_kernel[grid](
                *common, HAS_BIAS=bias is not None, EPILOGUE=epilogue, STAGES=tiles.stages, GROUP_M=tiles.group_m,
                BLOCK_N=tiles.block_n, SPLIT=tiles.split, NBUF=tiles.store_buffers,
                RES_ROWS=tiles.block_m if epilogue == RESIDUAL else 8, PRODUCER_REGS=PRODUCER_REGISTERS,
                num_warps=tiles.warps,
            )  # fmt: skip
        else:
            _gemm_epilogue_kernel[grid](*common, HAS_BIAS=bias is not None, EPILOGUE=epilogue, STAGES=tiles.stages,
                                        GROUP_M=tiles.group_m, num_warps=tiles.warps)  # fmt: skip


def linear_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_from: int, *,
                write_post: bool = True, config: str = DEFAULT_CONFIG,
                post: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """As :func:`gem_kernels.linear_epilogue_triton.linear_silu`, on a Hopper GPU (:func:`supported`)."""
    from gem_kernels.linear_epilogue_triton import _check_buffer, check_shapes

    tiles = _config(config)
    check_shapes(x, weight, bias, silu_from, tiles)  # type: ignore[arg-type]  (reads block_n only)
    x, weight = x.contiguous(), weight.contiguous()
    m, n = x.shape[0], weight.shape[0]
    pre = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if post is None:
        post = torch.empty((m, n - silu_from), dtype=x.dtype, device=x.device)
    _check_buffer("post", post, (m, n - silu_from), x)
    _launch(x, weight, bias, pre, post, silu_from, SILU if write_post and silu_from < n else 0, config)
    return pre, post


def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, *,
                    config: str = DEFAULT_CONFIG) -> torch.Tensor:  # fmt: skip
    """As :func:`gem_kernels.linear_epilogue_triton.linear_residual`, on a Hopper GPU (:func:`supported`)."""
    from gem_kernels.linear_epilogue_triton import _check_buffer, check_shapes

    tiles = _config(config)
    check_shapes(x, weight, bias, 0, tiles)  # type: ignore[arg-type]
    x, weight = x.contiguous(), weight.contiguous()
    m, n = x.shape[0], weight.shape[0]
    _check_buffer("residual", residual, (m, n), x)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, residual.contiguous(), 0, RESIDUAL, config)
    return out
