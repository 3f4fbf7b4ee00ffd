"""Jagged HSTU attention forward for Hopper (sm_90) in Gluon: the next ``q k^T`` runs on the tensor
cores while the current scores go through the silu.

Same operation as :mod:`gem_kernels.attention_triton`'s forward (no relative bias, no window)::

    out[i, h] = sum_j mask(i, j) * silu(alpha * <q[i, h], k[j, h]>) / N * v[j, h]

Why a second kernel. On the H200 the Triton forward keeps the tensor pipe busy about half of its
cycles (Nsight, 2026-12-04): it waits for each ``q k^T`` before its silu, and Triton 3.6 does not
generate a producer / consumer split for Hopper. Gluon (Triton's lower-level language) writes the
schedule by hand, FlashAttention-3's way, in one partition of 4 or 8 warps:

* key and value tiles come by TMA into a ring of ``STAGES`` shared-memory slots, each with an
  mbarrier; a slot is reloaded as soon as the MMA that read it has retired;
* each step issues ``S_i = q k_i^T`` and ``O += P_{i-1} v_{i-1}`` as asynchronous warpgroup MMAs,
  waits for ``S_i`` only, and computes ``P_i = silu(alpha S_i)`` (one ``tanh.approx`` per score, as
  the Triton kernel) while the tensor cores run ``P_{i-1} v_{i-1}``;
* ``P`` goes to the second MMA from registers (no shared-memory round trip).

The ``ws_*`` configs run :mod:`gem_kernels.attention_gluon_ws`'s kernel: the same math with the loads
in a producer warp of their own. :mod:`gem_kernels.attention_gluon_dq` and
:mod:`gem_kernels.attention_gluon_dkdv` are the backward's ``dq`` and ``dk``/``dv`` passes with this
schedule (:data:`DQ`, :func:`dq`; :data:`DKDV`, :func:`dkdv`).

Tiles and their order are the Triton forward's: (sequence, head, block of ``BLOCK_M`` query rows),
claimed from a queue by a persistent grid through an atomic counter, the last block of a sequence
first; key blocks wholly inside the mask run without mask math, and target rows skip the key blocks
between the history and their diagonal.

What it does not do (the Triton kernel does): relative biases, ``max_attn_len``, fp8 inputs, the
``dq`` pass, head dims other than 64 and 128, and any GPU other than sm_90. :func:`supported` says
whether a call qualifies; :func:`gem_kernels.attention_triton.query_major` routes there when
:data:`FORWARD` is on (off by default: the kernel is compiled and checked on the CPU for sm_90, its
numbers on the GPU are ``benchmarks/attention_gluon.py``'s to give).
"""

from __future__ import annotations

from typing import Any

import torch

try:  # Gluon ships with Triton 3.5+; its Hopper module is what this kernel needs
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

FORWARD = False
"""Route qualifying forward calls of ``query_major`` here (read at call time)."""
DQ = False
"""Route qualifying ``dq`` passes of ``query_major`` to :mod:`gem_kernels.attention_gluon_dq` (read at
call time)."""
DKDV = False
"""Route qualifying ``key_major`` calls (no atomic ``dq``, no bias) to :mod:`gem_kernels.attention_gluon_dkdv`
(read at call time)."""

CONFIGS: dict[str, tuple[int, int, int, int, int]] = {
    # name: (BLOCK_M, BLOCK_N, num_warps, STAGES, programs per SM). 8 warps = two warpgroups of 64 query
    # rows each. Shared memory (sm_90 build): m128n64 128 KiB, m64n64 ~80 KiB (two programs fit an SM's
    # 228 KiB); the n128 tiles take all 255 registers and spill 8 bytes.
    "m128n64": (128, 64, 8, 3, 1),
    "m64n64": (64, 64, 4, 2, 2),
    "m128n128": (128, 128, 8, 2, 1),
    "m64n128": (64, 128, 4, 2, 1),
    # the loads in a producer warp of their own (attention_gluon_ws): one program an SM, its consumer
    # warpgroups at 240 registers (setmaxnreg), two query slots; no spills at either key block
    "ws_m128n64": (128, 64, 8, 3, 1),
    "ws_m128n128": (128, 128, 8, 2, 1),
}
DQ_CONFIGS = ("m128n64", "m64n64")
"""The configs the ``dq`` pass takes (one partition; in the sm_90 build both take 255 registers and
spill 8 bytes, the 128-wide key blocks 576)."""
DEFAULT_DQ_CONFIG = "m128n64"
DKDV_CONFIGS: dict[str, tuple[int, int, int, int, int]] = {
    # name: (BLOCK_M queries a step, BLOCK_N keys a tile, num_warps, STAGES, programs per SM):
    # two warpgroups of 64 keys, dk and dv in registers. In the sm_90 build both take 255 registers;
    # 32-query steps spill 8 bytes, 64-query steps 312 (the Triton kernel's best is 32 x 128 too)
    "n128m32": (32, 128, 8, 3, 1),
    "n128m64": (64, 128, 8, 2, 1),
}
DEFAULT_DKDV_CONFIG = "n128m32"
PRODUCER_REGISTERS = 40
"""Registers of the ``ws_*`` configs' producer warp (it computes addresses and waits on barriers)."""
DEFAULT_CONFIG = "m128n64"
"""The launch used unless ``config`` says otherwise (a guess until timed on the GPU)."""

CHUNK = 128
"""Sequences read per step of the queue scan (as the Triton kernel's ``CHUNK``)."""

HEAD_DIMS = (64, 128)


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

    @gluon.jit(do_not_specialize=["num_seqs", "num_heads"])
    def forward_kernel(
        q_desc, k_desc, v_desc, OUT, SEQ_OFFSETS, NUM_TARGETS, COUNTER,
        stride_om, stride_oh, num_seqs, num_heads, half_alpha, out_scale,
        HAS_TARGETS: gl.constexpr, CHUNK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        DQK: gl.constexpr, DV: gl.constexpr, STAGES: gl.constexpr,
    ):
        NUM_WARPS: gl.constexpr = gl.num_warps()
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                           instr_shape=[16, DV, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        chunk_layout: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])

        q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, DQK], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DQK], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, DV], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        kv_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for st in gl.static_range(STAGES):
            mbarrier.init(kv_bars.index(st), count=1)
        fence_async_shared()

        rows_s = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        cols_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        rows_o = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols_o = gl.arange(0, DV, layout=gl.SliceLayout(0, o_layout))

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

                k_col = head * DQK
                v_col = head * DV

                for i in gl.static_range(STAGES):  # fill the ring
                    _load_kv(k_desc, v_desc, k_smem, v_smem, kv_bars, (loads + i) % STAGES,
                             seq_start + _block_start(i, n_hist, diag_lo, BLOCK_N), k_col, v_col, i < n_blocks)

                queries = m0 + rows_s
                mbarrier.wait(q_bar, q_phase)
                q_phase ^= 1

                # block 0: its scores alone
                slot = loads % STAGES
                mbarrier.wait(kv_bars.index(slot), (loads // STAGES) & 1)
                s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)),
                                  gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
                s = warpgroup_mma_wait(0, deps=[s])
                start = _block_start(0, n_hist, diag_lo, BLOCK_N)
                if start + BLOCK_N > full_hi:
                    w = _weights(s, half_alpha, queries, start + cols_s, seq_len, history_len, True)
                else:
                    w = _weights(s, half_alpha, queries, start + cols_s, seq_len, history_len, False)
                p = gl.convert_layout(w.to(dtype), p_layout)
                acc = gl.zeros([BLOCK_M, DV], gl.float32, o_layout)
                for i in range(1, n_blocks):
                    prev = (loads + i - 1) % STAGES
                    slot = (loads + i) % STAGES
                    mbarrier.wait(kv_bars.index(slot), ((loads + i) // STAGES) & 1)
                    s = warpgroup_mma(q_smem, k_smem.index(slot).permute((1, 0)),
                                      gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False,
                                      is_async=True)
                    acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
                    s = warpgroup_mma_wait(1, deps=[s])  # this block's scores; the previous P v may run on
                    start = _block_start(i, n_hist, diag_lo, BLOCK_N)
                    if start + BLOCK_N > full_hi:
                        w = _weights(s, half_alpha, queries, start + cols_s, seq_len, history_len, True)
                    else:
                        w = _weights(s, half_alpha, queries, start + cols_s, seq_len, history_len, False)
                    acc = warpgroup_mma_wait(0, deps=[acc, p])[0]
                    p = gl.convert_layout(w.to(dtype), p_layout)
                    # block i - 1's slot is free: it takes block i - 1 + STAGES
                    nxt = i - 1 + STAGES
                    _load_kv(k_desc, v_desc, k_smem, v_smem, kv_bars, prev,
                             seq_start + _block_start(nxt, n_hist, diag_lo, BLOCK_N), k_col, v_col, nxt < n_blocks)
                last = (loads + n_blocks - 1) % STAGES
                acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
                loads += n_blocks  # block b of a tile went to slot (loads + b) % STAGES

                out_rows = (seq_start + m0 + rows_o).to(gl.int64)
                ptrs = OUT + out_rows[:, None] * stride_om + head * stride_oh + cols_o[None, :]
                ok = (m0 + rows_o) < seq_len
                gl.store(ptrs, (acc * out_scale).to(OUT.dtype.element_ty), mask=ok[:, None])
                tile = next_tile
            tiles_before = chunk_end
        mbarrier.invalidate(q_bar)
        for st in gl.static_range(STAGES):
            mbarrier.invalidate(kv_bars.index(st))
        done = gl.atomic_add(COUNTER + 1, 1)
        if done == gl.num_programs(0) - 1:  # the last program out zeroes the queue for the next launch
            gl.atomic_xchg(COUNTER, 0)
            gl.atomic_xchg(COUNTER + 1, 0)


def shared_layout(block: list[int], dtype: torch.dtype) -> Any:
    """The NVMMA (wgmma-readable, 128-byte swizzled) shared layout of a ``block`` tile."""
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *grad_out: torch.Tensor) -> bool:
    """Whether these kernels can take the forward (or with ``grad_out``, the ``dq`` pass) of these
    ``[L, H, D]`` tensors on their device."""
    if not HAVE_GLUON or not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in (k, v, *grad_out)):
        return False
    if q.shape[2] not in HEAD_DIMS or v.shape[2] not in HEAD_DIMS or k.shape[2] != q.shape[2]:
        return False
    if any(g.shape != v.shape for g in grad_out):
        return False
    for t in (q, k, v, *grad_out):  # heads side by side in a row, rows 16-byte aligned: a 2-D TMA view
        if t.stride(2) != 1 or t.stride(1) != t.shape[2] or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def row_view_descriptor(t: torch.Tensor, block_rows: int) -> Any:
    """A host tensor descriptor over ``[L, H, D]`` seen as ``[L, H D]``, in ``[block_rows, D]`` tiles."""
    rows, heads, dim = t.shape
    block = [block_rows, dim]
    return TensorDescriptor(t, [rows, heads * dim], [t.stride(0), 1], block, shared_layout(block, t.dtype))


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    *,
    max_seq_len: int,
    alpha: float,
    out: torch.Tensor | None = None,
    config: str | None = None,
) -> torch.Tensor:
    """The attention output ``[L, H, Dv]``; the caller has checked :func:`supported`."""
    from gem_kernels.attention_triton_common import device_guard, queue_counter

    rows, heads, dim_qk = q.shape
    dim_v = v.shape[2]
    if out is None:
        out = torch.empty((rows, heads, dim_v), dtype=v.dtype, device=v.device)
    num_seqs = seq_offsets.shape[0] - 1
    if rows == 0 or num_seqs <= 0:
        return out
    name = config or DEFAULT_CONFIG
    if name not in CONFIGS:
        raise ValueError(f"attention_gluon.forward: config {name!r} is not one of {sorted(CONFIGS)}")
    block_m, block_n, warps, stages, per_sm = CONFIGS[name]
    descriptors = (row_view_descriptor(q, block_m), row_view_descriptor(k, block_n), row_view_descriptor(v, block_n))
    targets = num_targets if num_targets is not None else seq_offsets
    scalars = (out.stride(0), out.stride(1), num_seqs, heads, 0.5 * float(alpha), 1.0 / max_seq_len)
    constants = dict(HAS_TARGETS=num_targets is not None, CHUNK=CHUNK, BLOCK_M=block_m, BLOCK_N=block_n,
                     DQK=dim_qk, DV=dim_v, STAGES=stages, num_warps=warps)  # fmt: skip
    with device_guard(q.device):
        grid = (torch.cuda.get_device_properties(q.device).multi_processor_count * per_sm,)
        if name.startswith("ws_"):
            from gem_kernels.attention_gluon_ws import forward_ws_kernel

            forward_ws_kernel[grid](*descriptors, out, seq_offsets, targets, *scalars,
                                    PRODUCER_REGS=PRODUCER_REGISTERS, **constants)  # fmt: skip
        else:
            forward_kernel[grid](*descriptors, out, seq_offsets, targets, queue_counter(q.device), *scalars,
                                 **constants)  # fmt: skip
    return out


def dq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    *,
    max_seq_len: int,
    alpha: float,
    out: torch.Tensor | None = None,
    config: str | None = None,
) -> torch.Tensor:
    """``dq`` ``[L, H, Dqk]`` of the attention (:mod:`gem_kernels.attention_gluon_dq`); the caller has
    checked :func:`supported` with ``grad_out``."""
    from gem_kernels.attention_triton_common import device_guard, queue_counter

    rows, heads, dim_qk = q.shape
    if out is None:
        out = torch.empty((rows, heads, dim_qk), dtype=q.dtype, device=q.device)
    num_seqs = seq_offsets.shape[0] - 1
    if rows == 0 or num_seqs <= 0:
        return out
    name = config or DEFAULT_DQ_CONFIG
    if name not in DQ_CONFIGS:
        raise ValueError(f"attention_gluon.dq: config {name!r} is not one of {list(DQ_CONFIGS)}")
    block_m, block_n, warps, stages, per_sm = CONFIGS[name]
    from gem_kernels.attention_gluon_dq import dq_kernel

    with device_guard(q.device):
        grid = (torch.cuda.get_device_properties(q.device).multi_processor_count * per_sm,)
        dq_kernel[grid](
            row_view_descriptor(q, block_m), row_view_descriptor(grad_out, block_m), row_view_descriptor(k, block_n),
            row_view_descriptor(v, block_n), out, seq_offsets, num_targets if num_targets is not None else seq_offsets,
            queue_counter(q.device), out.stride(0), out.stride(1), num_seqs, heads, 0.5 * float(alpha),
            float(alpha) / max_seq_len, HAS_TARGETS=num_targets is not None, CHUNK=CHUNK, BLOCK_M=block_m,
            BLOCK_N=block_n, DQK=dim_qk, DV=v.shape[2], STAGES=stages, num_warps=warps,
        )
    return out


def dkdv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    *,
    max_seq_len: int,
    alpha: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dk``, ``dv`` of the attention (:mod:`gem_kernels.attention_gluon_dkdv`), into ``out`` if given;
    the caller has checked :func:`supported` with ``grad_out``."""
    from gem_kernels.attention_triton_common import device_guard, queue_counter

    rows, heads, dim_qk = q.shape
    dk, dv = out if out is not None else (torch.empty_like(k, memory_format=torch.contiguous_format),
                                          torch.empty_like(v, memory_format=torch.contiguous_format))  # fmt: skip
    num_seqs = seq_offsets.shape[0] - 1
    if rows == 0 or num_seqs <= 0:
        return dk, dv
    name = config or DEFAULT_DKDV_CONFIG
    if name not in DKDV_CONFIGS:
        raise ValueError(f"attention_gluon.dkdv: config {name!r} is not one of {sorted(DKDV_CONFIGS)}")
    block_m, block_n, warps, stages, per_sm = DKDV_CONFIGS[name]
    from gem_kernels.attention_gluon_dkdv import dkdv_kernel

    with device_guard(q.device):
        grid = (torch.cuda.get_device_properties(q.device).multi_processor_count * per_sm,)
        dkdv_kernel[grid](
            row_view_descriptor(q, block_m), row_view_descriptor(grad_out, block_m), row_view_descriptor(k, block_n),
            row_view_descriptor(v, block_n), dk, dv, seq_offsets, num_targets if num_targets is not None else seq_offsets,
            queue_counter(q.device), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), num_seqs, heads,
            0.5 * float(alpha), float(alpha) / max_seq_len, 1.0 / max_seq_len, HAS_TARGETS=num_targets is not None,
            CHUNK=CHUNK, BLOCK_M=block_m, BLOCK_N=block_n, DQK=dim_qk, DVD=v.shape[2], STAGES=stages, num_warps=warps,
        )
    return dk, dv
