"""Backward of jagged HSTU attention in Triton: the key-major ``dk``/``dv`` pass (and ``dq``).

One tile = (sequence, head, block of ``BLOCK_N`` keys). The tile keeps ``k``, ``v`` and the ``dk``,
``dv`` accumulators on chip and walks the query blocks that see its keys: unmasked ones without mask
math, the diagonal, window-edge and target blocks masked. Five MMAs per (query block, key block)
pair: ``s^T = k q^T``, ``dp^T = v g^T``, ``dv += silu(s)^T g``, ``dk += ds^T q`` and, with
``ATOMIC_DQ``, ``dq^T += k^T ds^T`` (:data:`TRANSPOSED_DQ`) added into an fp32 buffer with relaxed
atomics (concurrent tiles are neighbouring key blocks of the same sequence, so those atomics stay in
L2). Without ``ATOMIC_DQ`` a query-major pass computes ``dq`` instead (three more MMAs: ``s``, ``dp``
are recomputed).
The queue is the forward's, over key blocks, first key block (the one most queries see) first.
With relative biases, each (query block, key block) pair also adds its share of the bias gradients
(pre-reduced in the tile: :func:`gem_kernels.attention_triton_bias.position_grad` and ``time_grad``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels import attention_gluon
from gem_kernels.attention_stored import StoredScores, head_base, store_tile_elements
from gem_kernels.attention_triton import KEY_NAMES
from gem_kernels.attention_triton_bias import (
    NO_BIAS,
    POSITION_STRIPES,
    TIME_STRIPES,
    BiasGrads,
    RelativeBias,
    position_grad,
    relative_bias,
    time_grad,
)
from gem_kernels.attention_triton_common import (
    CHUNK,
    INTERPRET,
    allowed,
    cast,
    device_guard,
    dim_block,
    dot,
    history_length,
    length_buckets,
    load_tile,
    locate_tile,
    queue_counter,
    release_queue,
    row_descriptor,
    scan_chunk,
    silu_and_grad,
    silu_and_grad_biased,
    silu_mode,
    tma_loads,
)
from gem_kernels.launcher import Config, TunedKernel, fixed_config

# (BLOCK_M queries per step, BLOCK_N keys per tile, num_warps, num_stages, programs per SM): from
# ptxas reports for sm_90 at head dim 128, tiles whose two fp32 accumulators fit 255 registers
# without (or with a few bytes of) spills. Small query steps keep s^T and dp^T small, but then the
# atomic dq product (M = BLOCK_M < 64) runs on mma.sync rather than wgmma; 64 x 64 keeps wgmma.
# 64-key tiles pad less of each sequence's last key block, which pays on short sequences
# (16 x 64: 180 registers, 218 with the atomic dq). 4-warp key tiles spill (two 64 x 128 fp32
# accumulators in 128 threads), so every config here is one program per SM.
CONFIGS: list[Config] = [
    (32, 128, 8, 3, 1), (16, 128, 8, 3, 1), (32, 128, 8, 2, 1), (32, 64, 8, 3, 1), (64, 64, 8, 2, 1), (16, 64, 8, 3, 1),
]
WIDE_CONFIGS: list[Config] = [(16, 64, 8, 2, 1), (16, 32, 8, 2, 1), (16, 32, 4, 2, 2)]  # head dims above 128
INTERPRETER_CONFIGS: list[Config] = [(16, 16, 1, 1, 1)]


TMA_LOADS = False
"""Whether the dk/dv pass loads its query and output-gradient tiles by tensor descriptors (where
:func:`~gem_kernels.attention_triton_common.tma_loads` allows). Off: on the H200 it was slower at every
length (0.98x on the big config's lengths, 0.91-0.94x on uniform ones; 2026-12-04,
``benchmarks/attention_loads.py``). Its registers stay at 255 either way for every candidate from 16 x 128
to 64 x 128 (its two float32 accumulators bind it, not addresses), while the forward and the dq pass,
freed of their address registers, gained up to 1.20x and 1.07x."""


TRANSPOSED_DQ = True
"""With atomic dq, whether the key-major pass computes ``dq^T = k^T ds^T`` (M = the head dim: a ``wgmma``
at any query step) rather than ``dq = ds k`` (M = the query step, 16-32 rows: ``mma.sync`` on Hopper).
The whole backward with atomic dq, H200, 2026-12-04 (``benchmarks/atomic_dq.py``, 12-15 rotated rounds,
medians, ms): big config 7.469 -> 6.869 (1.087x), N = 1024 / 4096 uniform 6.080 -> 5.576 / 76.96 -> 66.38
(1.090x / 1.159x), N = 256 s = 0.3 0.368 -> 0.335, N = 1024 s = 0.3 1.247 -> 1.165, MovieLens-like
(B 128, H 2, D 64) 0.151 -> 0.142. The separate dq pass stays faster where ``auto`` picks it (big config
6.150 ms, N = 1024 5.073): the float32 atomics, the buffer's zeroing and its cast, not the MMA, are what
atomic dq costs there."""


def _configs(wide: bool) -> list[Config]:
    return INTERPRETER_CONFIGS if INTERPRET else (WIDE_CONFIGS if wide else CONFIGS)


@triton.jit
def _key_block_ranges(n0, seq_len, history_len, max_attn_len, HAS_WINDOW: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query blocks that see keys ``n0 .. n0 + BLOCK_N``: unmasked ``[full_lo, full_hi)``, masked
    ``[diag_lo, full_lo) + [full_hi, rows_end)``."""
    keys_end = tl.minimum(n0 + BLOCK_N, seq_len)
    diag_lo = n0 // BLOCK_M * BLOCK_M
    full_lo = tl.cdiv(keys_end, BLOCK_M) * BLOCK_M
    whole_blocks_end = seq_len // BLOCK_M * BLOCK_M  # unmasked blocks hold no row past the sequence
    last_history_key = tl.minimum(keys_end, history_len) - 1
    if HAS_WINDOW:
        # Every target row sits at p = history_len, within the window of a key iff history_len - j <= W.
        rows_end = tl.where(history_len <= last_history_key + max_attn_len, seq_len,
                            tl.minimum(seq_len, last_history_key + max_attn_len + 1))
        full_hi = tl.where(history_len <= n0 + max_attn_len, whole_blocks_end,
                           tl.minimum(whole_blocks_end, (n0 + max_attn_len + 1) // BLOCK_M * BLOCK_M))
    else:
        rows_end = seq_len
        full_hi = whole_blocks_end
    rows_end = tl.where(n0 < history_len, rows_end, keys_end)  # target keys: seen by themselves only
    # Target keys are masked for every row but their own, so a block holding one has no unmasked rows.
    full_hi = tl.where(keys_end <= history_len, tl.maximum(full_hi, full_lo), full_lo)
    n_diag = (full_lo - diag_lo) // BLOCK_M
    n_tail = tl.cdiv(tl.maximum(rows_end - full_hi, 0), BLOCK_M)
    return diag_lo, full_lo, full_hi, n_diag, n_tail


@triton.jit
def _key_block_step(dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, start, stride_qm, stride_dom, stride_dqm,
                    offs_m, n0, keys, d_qk_ok, d_v_ok, seq_len, history_len, max_attn_len, alpha, max_seq_len,
                    PB, TB, EDGES, query_times, key_t, DPB, DTB, pos_offset, num_buckets,
                    q_desc, do_desc, query_row, q_col, do_col, DS, ds_base, STORE_DS: tl.constexpr, TMA: tl.constexpr,
                    MASKED: tl.constexpr, ATOMIC_DQ: tl.constexpr, DQ_T: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr, POS_GRAD: tl.constexpr, TIME_GRAD: tl.constexpr,
                    SILU: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                    CHECK_QK: tl.constexpr, CHECK_V: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    queries = start + offs_m
    queries_ok = queries < seq_len
    if TMA:  # whole tiles: rows past the sequence (the next one's, or zeros) are masked below
        q = q_desc.load([query_row + start, q_col])
        do = do_desc.load([query_row + start, do_col])
    else:
        q = load_tile(q_ptrs + start * stride_qm, queries_ok, d_qk_ok, MASKED, CHECK_QK)
        do = load_tile(do_ptrs + start * stride_dom, queries_ok, d_v_ok, MASKED, CHECK_V)
    s_t = dot(k, tl.trans(q), None, IEEE, INTERP)
    if HAS_POS or HAS_TIME:
        query_t = queries
        if HAS_TIME:
            if MASKED:
                query_t = tl.load(query_times + queries, mask=queries_ok, other=0)
            else:
                query_t = tl.load(query_times + queries)
        r_t, bucket_t = relative_bias(PB, TB, EDGES, queries[None, :], keys[:, None], query_t[None, :],
                                      key_t[:, None], pos_offset, num_buckets, HAS_POS, HAS_TIME)
        silu_t, grad_t = silu_and_grad_biased(s_t, alpha, r_t, SILU)
    else:
        silu_t, grad_t = silu_and_grad(s_t, alpha, SILU)
    ds_t = dot(v, tl.trans(do), None, IEEE, INTERP) * grad_t
    if MASKED:
        keep = allowed(queries[None, :], keys[:, None], history_len, max_attn_len, HAS_WINDOW)
        if TMA:  # the causal mask lets rows past the sequence see its keys: they are the next sequence's
            keep &= queries_ok[None, :]
        silu_t = tl.where(keep, silu_t, 0.0)
        ds_t = tl.where(keep, ds_t, 0.0)
    # ds_t is d out / d r (times N) for every (key, query) pair: zero where masked or padded
    if POS_GRAD:
        position_grad(DPB, ds_t, n0 - start + pos_offset, 2 * pos_offset + 1, BLOCK_N, BLOCK_M)
    if TIME_GRAD:
        time_grad(DTB, ds_t, bucket_t, num_buckets)
    dv = dot(cast(silu_t, do.dtype, INTERP), do, dv, IEEE, INTERP)
    ds_t = cast(ds_t, q.dtype, INTERP)
    if STORE_DS:  # for the dq pass (gem_kernels.attention_stored)
        store_tile_elements(DS, ds_base, ds_t, keys, queries, seq_len)
    dk = dot(ds_t, q, dk, IEEE, INTERP)
    if ATOMIC_DQ:
        # Scaled here so that the buffer only needs a cast afterwards, not another full read and write.
        if DQ_T:  # dq^T = k^T ds^T: M is the head dim, so the MMA is a wgmma at any query step
            dq_t = dot(tl.trans(k), ds_t, None, IEEE, INTERP) * (alpha / max_seq_len)
            tl.atomic_add(dq_ptrs + start * stride_dqm, dq_t, mask=d_qk_ok[:, None] & queries_ok[None, :],
                          sem="relaxed")
        else:
            dq = dot(tl.trans(ds_t), k, None, IEEE, INTERP) * (alpha / max_seq_len)
            tl.atomic_add(dq_ptrs + start * stride_dqm, dq, mask=queries_ok[:, None] & d_qk_ok[None, :],
                          sem="relaxed")
    return dk, dv


# no recompiles for B = 1, H = 1, W = 1, nor per max_seq_len or bucket count
@triton.jit(do_not_specialize=["num_seqs", "num_heads", "num_rows", "max_attn_len", "pos_offset", "num_buckets"])
def key_major_kernel(
    Q, K, V, DO, DQ, DK, DV, SEQ_OFFSETS, NUM_TARGETS, COUNTER, PB, TB, EDGES, TS, QTS, DPB, DTB, DS, DS_BASE,
    stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh, stride_dom, stride_doh,
    stride_dqm, stride_dqh, stride_dkm, stride_dkh, stride_dvm, stride_dvh,
    num_seqs, num_heads, num_rows, alpha, max_seq_len, max_attn_len, pos_offset, num_buckets,
    DQK: tl.constexpr, DV_DIM: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, DQ_T: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_POS_BIAS: tl.constexpr, HAS_TIME_BIAS: tl.constexpr, POS_GRAD: tl.constexpr, TIME_GRAD: tl.constexpr,
    POS_STRIPES: tl.constexpr, TIME_STRIPES: tl.constexpr,
    SILU: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr, CHUNK: tl.constexpr, TMA: tl.constexpr,
    STORE_DS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr,
):
    """dk, dv (and dq with ``ATOMIC_DQ``) for every (sequence, head, key block) tile; with ``POS_GRAD`` /
    ``TIME_GRAD`` also the bias gradients (times N) into ``DPB`` ``[POS_STRIPES, 2 N - 1]`` and ``DTB``
    ``[TIME_STRIPES, num_buckets]``. Bias arguments as in ``query_major_kernel``. ``TMA``: the query and
    output-gradient tiles come by tensor descriptors over ``[num_rows, num_heads * D]``. ``STORE_DS``: every
    ``ds`` tile also goes into ``DS`` (:mod:`gem_kernels.attention_stored`'s layout, ``DS_BASE`` its bases)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_qk = tl.arange(0, BLOCK_DQK)
    offs_v = tl.arange(0, BLOCK_DV)
    d_qk_ok = offs_qk < DQK
    d_v_ok = offs_v < DV_DIM
    CHECK_QK: tl.constexpr = DQK != BLOCK_DQK
    CHECK_V: tl.constexpr = DV_DIM != BLOCK_DV
    if POS_GRAD:  # this program's stripe of the gradient buffers
        DPB = DPB + (tl.program_id(0) % POS_STRIPES) * (2 * pos_offset + 1)
    if TIME_GRAD:
        DTB = DTB + (tl.program_id(0) % TIME_STRIPES) * num_buckets
    q_desc = Q  # unused without TMA
    do_desc = DO
    if TMA:
        q_desc = row_descriptor(Q, num_rows, num_heads * DQK, stride_qm, BLOCK_M, BLOCK_DQK)
        do_desc = row_descriptor(DO, num_rows, num_heads * DV_DIM, stride_dom, BLOCK_M, BLOCK_DV)
    tile = tl.atomic_add(COUNTER, 1, sem="relaxed")
    tiles_before = tile * 0
    for chunk0 in range(0, num_seqs, CHUNK):
        tiles, tiles_end = scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before, BLOCK_N, CHUNK)
        chunk_end = tiles_before + tl.sum(tiles)
        while tile < chunk_end:
            seq, seq_start, seq_len, head, block, _ = locate_tile(
                tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, BLOCK_N
            )
            n0 = block * BLOCK_N
            keys = n0 + offs_n
            keys_ok = keys < seq_len
            k_rows = K + seq_start * stride_km + head * stride_kh + keys[:, None] * stride_km
            v_rows = V + seq_start * stride_vm + head * stride_vh + keys[:, None] * stride_vm
            k = load_tile(k_rows + offs_qk[None, :], keys_ok, d_qk_ok, True, CHECK_QK)
            v = load_tile(v_rows + offs_v[None, :], keys_ok, d_v_ok, True, CHECK_V)
            q_ptrs = Q + seq_start * stride_qm + head * stride_qh + offs_m[:, None] * stride_qm + offs_qk[None, :]
            do_ptrs = DO + seq_start * stride_dom + head * stride_doh + offs_m[:, None] * stride_dom + offs_v[None, :]
            dq_head = DQ + seq_start * stride_dqm + head * stride_dqh
            if DQ_T:  # [D, BLOCK_M] tiles of dq^T
                dq_ptrs = dq_head + offs_qk[:, None] + offs_m[None, :] * stride_dqm
            else:
                dq_ptrs = dq_head + offs_m[:, None] * stride_dqm + offs_qk[None, :]
            history_len = history_length(NUM_TARGETS, seq, seq_len, HAS_TARGETS)
            ds_base = seq_start * 0
            if STORE_DS:
                ds_base = head_base(DS_BASE, seq, head, seq_len)
            query_times = QTS
            key_t = keys
            if HAS_TIME_BIAS:
                query_times = QTS + seq_start
                key_t = tl.load(TS + seq_start + keys, mask=keys_ok, other=0)
            # The next tile. Relaxed: only atomicity matters, and acq_rel made each claim wait for the
            # previous tile's output stores to drain. Triton hands a scalar atomic's result to every
            # thread through shared memory behind a barrier, so the program waits for the round trip
            # wherever it claims: here, at least, with this tile's targets load in flight.
            next_tile = tl.atomic_add(COUNTER, 1, sem="relaxed")
            diag_lo, full_lo, full_hi, n_diag, n_tail = _key_block_ranges(
                n0, seq_len, history_len, max_attn_len, HAS_WINDOW, BLOCK_M, BLOCK_N
            )
            dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
            dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
            for start in range(full_lo, full_hi, BLOCK_M):
                dk, dv = _key_block_step(
                    dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, start, stride_qm, stride_dom, stride_dqm, offs_m,
                    n0, keys, d_qk_ok, d_v_ok, seq_len, history_len, max_attn_len, alpha, max_seq_len, PB, TB,
                    EDGES, query_times, key_t, DPB, DTB, pos_offset, num_buckets, q_desc, do_desc,
                    seq_start.to(tl.int32), head * DQK, head * DV_DIM, DS, ds_base, STORE_DS, TMA, False, ATOMIC_DQ, DQ_T, HAS_WINDOW,
                    HAS_POS_BIAS, HAS_TIME_BIAS, POS_GRAD, TIME_GRAD, SILU, IEEE, INTERP, CHECK_QK, CHECK_V,
                    BLOCK_M, BLOCK_N,
                )
            for i in range(0, n_diag + n_tail):
                start = tl.where(i < n_diag, diag_lo + i * BLOCK_M, full_hi + (i - n_diag) * BLOCK_M)
                dk, dv = _key_block_step(
                    dk, dv, k, v, q_ptrs, do_ptrs, dq_ptrs, start, stride_qm, stride_dom, stride_dqm, offs_m,
                    n0, keys, d_qk_ok, d_v_ok, seq_len, history_len, max_attn_len, alpha, max_seq_len, PB, TB,
                    EDGES, query_times, key_t, DPB, DTB, pos_offset, num_buckets, q_desc, do_desc,
                    seq_start.to(tl.int32), head * DQK, head * DV_DIM, DS, ds_base, STORE_DS, TMA, True, ATOMIC_DQ, DQ_T, HAS_WINDOW,
                    HAS_POS_BIAS, HAS_TIME_BIAS, POS_GRAD, TIME_GRAD, SILU, IEEE, INTERP, CHECK_QK, CHECK_V,
                    BLOCK_M, BLOCK_N,
                )
            dk_ptrs = DK + seq_start * stride_dkm + head * stride_dkh + keys[:, None] * stride_dkm + offs_qk[None, :]
            dv_ptrs = DV + seq_start * stride_dvm + head * stride_dvh + keys[:, None] * stride_dvm + offs_v[None, :]
            tl.store(dk_ptrs, cast(dk * (alpha / max_seq_len), DK.dtype.element_ty, INTERP),
                     mask=keys_ok[:, None] & d_qk_ok[None, :])
            tl.store(dv_ptrs, cast(dv * (1.0 / max_seq_len), DV.dtype.element_ty, INTERP),
                     mask=keys_ok[:, None] & d_v_ok[None, :])
            tile = next_tile
        tiles_before = chunk_end
    release_queue(COUNTER)


_POINTERS = ("Q", "K", "V", "DO", "DQ", "DK", "DV", "SEQ_OFFSETS", "NUM_TARGETS", "COUNTER", "PB", "TB", "EDGES",
             "TS", "QTS", "DPB", "DTB", "DS", "DS_BASE")
# ``ds``: whether the pass also stores its score gradients (gem_kernels.attention_stored)
DKDV = TunedKernel("dkdv", key_major_kernel, pointers=_POINTERS, floats=("alpha", "max_seq_len"),
                   key_names=(*KEY_NAMES[:-2], "ds", *KEY_NAMES[-2:]))
DKDV_ATOMIC = TunedKernel(
    "dkdv_atomic", key_major_kernel, pointers=_POINTERS, floats=("alpha", "max_seq_len"),
    key_names=(*KEY_NAMES[:-2], "ds", "dq_form", *KEY_NAMES[-2:]),
)


def key_major(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    dq_accum: torch.Tensor | None,
    *,
    max_seq_len: int,
    alpha: float,
    max_attn_len: int,
    blocks: tuple[int, int] | None = None,
    bias: RelativeBias = NO_BIAS,
    bias_grads: BiasGrads | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    stored: StoredScores | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dk`` and ``dv``; with ``dq_accum`` (zeroed fp32 ``[L, H, Dqk]``) also adds ``dq`` into it, and
    with ``bias_grads`` (zeroed, :meth:`BiasGrads.zeros`) the bias gradients times ``max_seq_len``.
    ``out = (dk, dv)``: where to write them (``[L, H, D]`` views, unit last stride), else new tensors.
    ``stored``: also write every ``ds`` tile there, for :func:`gem_kernels.attention_stored.dq_from_stored`."""
    num_rows, num_heads, dim_qk = q.shape
    dim_v = v.shape[2]
    no_bias_grads = bias_grads is None or (bias_grads.position is None and bias_grads.time is None)
    if stored is not None and stored.heads is not None and stored.heads != num_heads:
        raise ValueError(f"key_major: the ds buffer holds the tiles of {stored.heads} heads, q has {num_heads}")
    if (attention_gluon.DKDV and dq_accum is None and no_bias_grads and blocks is None and max_attn_len <= 0
            and bias.position is None and bias.time is None and attention_gluon.supported(q, k, v, grad_out)):  # fmt: skip
        return attention_gluon.dkdv(q, k, v, grad_out, seq_offsets, num_targets, max_seq_len=max_seq_len, alpha=alpha,
                                    out=out, stored=stored)  # fmt: skip
    if stored is not None and (dq_accum is not None or max_attn_len > 0 or bias.position is not None
                               or bias.time is not None):  # fmt: skip
        raise ValueError("key_major: stored ds tiles are written without atomic dq, relative biases or a window")
    if out is not None:
        dk, dv = out
    else:
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)
    num_seqs = seq_offsets.shape[0] - 1
    if num_rows == 0 or num_seqs <= 0:
        return dk, dv
    device = q.device
    atomic = dq_accum is not None
    dq = dq_accum if dq_accum is not None else dk  # unused without ATOMIC_DQ: any tensor of the row layout
    has_targets = num_targets is not None
    has_window = max_attn_len > 0
    grads = bias_grads if bias_grads is not None else BiasGrads(None, None)
    grad_flags = (grads.position is not None, grads.time is not None)
    chunk = CHUNK  # read at call time: tests shrink it
    tma = TMA_LOADS and tma_loads(q, grad_out)
    variant = (q.dtype, dim_qk, dim_v, has_targets, has_window, bias.label(grad_flags), chunk,
               "auto" if blocks is None else blocks, "tma" if tma else "pointers", "stored" if stored is not None else "-")
    if atomic:
        variant += ("transposed" if TRANSPOSED_DQ else "rows",)

    def constexprs() -> dict:
        return dict(
            DQK=dim_qk, DV_DIM=dim_v, BLOCK_DQK=dim_block(dim_qk), BLOCK_DV=dim_block(dim_v), ATOMIC_DQ=atomic,
            DQ_T=atomic and TRANSPOSED_DQ,
            HAS_TARGETS=has_targets, HAS_WINDOW=has_window, HAS_POS_BIAS=bias.position is not None,
            HAS_TIME_BIAS=bias.time is not None, POS_GRAD=grad_flags[0], TIME_GRAD=grad_flags[1],
            POS_STRIPES=POSITION_STRIPES, TIME_STRIPES=TIME_STRIPES, SILU=silu_mode(q.dtype),
            IEEE=q.dtype == torch.float32, INTERP=INTERPRET, CHUNK=chunk, TMA=tma, STORE_DS=stored is not None,
        )

    def restore() -> None:  # tuning runs added into the accumulators
        if dq_accum is not None:
            dq_accum.zero_()
        grads.zero_()

    def tile_bound(config: Config) -> int:
        return num_seqs * num_heads * -(-max(max_seq_len, 1) // config[1])

    with device_guard(device):
        counter = queue_counter(device)
        args = (
            q, k, v, grad_out, dq, dk, dv, seq_offsets, num_targets if num_targets is not None else seq_offsets,
            counter, *bias.pointers(q), *grads.pointers(dq),
            *((stored.buffer, stored.base) if stored is not None else (dk, seq_offsets)),
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), grad_out.stride(0), grad_out.stride(1), dq.stride(0), dq.stride(1),
            dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), num_seqs, num_heads, num_rows, float(alpha),
            float(max_seq_len), max_attn_len, max_seq_len - 1, bias.num_buckets,
        )
        if blocks is not None:
            configs = [fixed_config(*blocks)]
            buckets: tuple[int, int] = (0, 0)
        else:
            configs = _configs(max(dim_qk, dim_v) > 128)
            buckets = length_buckets(max_seq_len, num_rows, num_seqs)
        (DKDV_ATOMIC if atomic else DKDV).launch(
            args, constexprs, variant=variant, buckets=buckets, configs=configs, device=device,
            tile_bound=tile_bound, after_tuning=restore,
        )
    return dk, dv
