"""Jagged HSTU attention in Triton: the forward pass and the query-major ``dq`` pass.

Operation
---------
Rows ``seq_offsets[b] : seq_offsets[b + 1]`` of ``q, k`` ``[L, H, Dqk]`` and ``v`` ``[L, H, Dv]`` form
sequence ``b`` of length ``n``; ``t = num_targets[b]`` (0 without targets), ``N = max_seq_len``,
``W = max_attn_len``. With positions local to the sequence and ``p(i) = min(i, n - t)``::

    out[i, h] = sum_j mask(i, j) * silu(alpha * <q[i, h], k[j, h]>) / N * v[j, h]
    mask(i, j) = (i == j) or (0 < p(i) - p(j) and (W == 0 or p(i) - p(j) <= W))

No term crosses sequences. Gradients (``s = alpha <q_i, k_j>``, ``g = d out``)::

    dv[j] = sum_i mask * silu(s) / N * g[i]
    ds    = mask * <g[i], v[j]> * silu'(s) / N
    dq[i] = alpha * sum_j ds * k[j],   dk[j] = alpha * sum_i ds * q[i]

Design
------
* One tile = (sequence, head, block of ``BLOCK_M`` query rows). Tiles live in a queue ordered by
  sequence, head, then block (longest-running block first); a persistent grid of
  ``programs_per_sm x SMs`` programs claims them with an atomic counter. The queue is never
  materialised: each program scans ``seq_offsets`` a chunk at a time, so no host sync, no padded
  grid, and no program is spent on padding.
* Per tile, key blocks that are out of the mask are skipped; key blocks entirely inside it (all
  rows see all keys) run without any mask math; only the diagonal, window-edge and target blocks
  are masked elementwise.
* ``silu`` for 16-bit inputs uses one ``tanh.approx`` (MUFU) per score instead of exp + reciprocal:
  with Dqk = Dv = 128 the exp/reciprocal pair would cost as much issue time as the two MMAs.
* Scores and accumulators are fp32; ``silu(s)`` and ``ds`` are cast to the input dtype for the
  second MMA (bf16 tensor cores), as flash attention does with probabilities.
* Head dims are padded with masked loads to a power of two >= 16, so 16, 25, 32 ... 256 all work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import (
    CHUNK,
    INTERPRET,
    allowed,
    cast,
    device_guard,
    dim_block,
    dot,
    fixed_block_warps,
    history_length,
    launch_once_tuned,
    load_tile,
    locate_tile,
    num_programs,
    scan_chunk,
    silu_and_grad,
    silu_mode,
)

# (BLOCK_M, BLOCK_N, num_warps, num_stages, programs per SM) for Hopper-class GPUs. Few on purpose:
# each is a compile of a large kernel. Chosen from ptxas reports for sm_90 at head dim 128: these
# stay within 255 registers without spilling (the 128 x 128 forward spills ~100 bytes; its larger
# key block halves the shared-memory reads of q k^T, so it stays a candidate). 8-warp tiles take a
# whole SM's registers; the 4-warp ones leave registers and shared memory for two programs per SM.
FORWARD_CONFIGS = [(128, 128, 8, 2, 1), (128, 64, 8, 2, 1), (128, 64, 8, 3, 1), (64, 64, 4, 2, 2)]
DQ_CONFIGS = [(128, 64, 8, 2, 1), (128, 64, 8, 3, 1), (128, 32, 8, 3, 1), (64, 32, 4, 3, 2)]
WIDE_CONFIGS = [(128, 32, 8, 2, 1), (64, 64, 8, 2, 1), (32, 64, 4, 2, 2)]  # head dims above 128
INTERPRETER_CONFIGS = [(16, 16, 1, 1, 1)]


def make_configs(wide: bool, compute_dq: bool) -> list[triton.Config]:
    if INTERPRET:
        table = INTERPRETER_CONFIGS
    else:
        table = WIDE_CONFIGS if wide else (DQ_CONFIGS if compute_dq else FORWARD_CONFIGS)
    return [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n, "PROGRAMS_PER_SM": p}, num_warps=w, num_stages=s)
        for m, n, w, s, p in table
    ]


@triton.jit
def _query_block_ranges(m0, seq_len, history_len, max_attn_len, HAS_WINDOW: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks of query rows ``m0 .. m0 + BLOCK_M``: the unmasked ones ``[full_lo, full_hi)`` and
    the masked ones ``[left, full_lo) + [full_hi, hist_end) + [diag_lo, rows_end)``."""
    rows_end = tl.minimum(m0 + BLOCK_M, seq_len)
    min_p = tl.minimum(m0, history_len)
    max_p = tl.minimum(rows_end - 1, history_len)
    if HAS_WINDOW:
        left = tl.maximum(min_p - max_attn_len, 0) // BLOCK_N * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(max_p - max_attn_len, 0), BLOCK_N) * BLOCK_N
    else:
        left = min_p * 0
        full_lo = left
    full_hi = tl.maximum(min_p // BLOCK_N * BLOCK_N, full_lo)
    hist_end = tl.cdiv(max_p, BLOCK_N) * BLOCK_N
    diag_lo = tl.maximum(m0 // BLOCK_N * BLOCK_N, hist_end)
    n_left = (full_lo - left) // BLOCK_N
    n_hist = (hist_end - full_hi) // BLOCK_N
    n_diag = tl.cdiv(tl.maximum(rows_end - diag_lo, 0), BLOCK_N)
    return full_lo, full_hi, left, diag_lo, n_left, n_hist, n_diag


@triton.jit
def _query_block_step(acc, q, do, k_ptrs, v_ptrs, start, stride_km, stride_vm, queries, offs_n,
                      d_qk_ok, d_v_ok, seq_len, history_len, max_attn_len, alpha,
                      MASKED: tl.constexpr, COMPUTE_DQ: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      SILU: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                      CHECK_QK: tl.constexpr, CHECK_V: tl.constexpr):
    keys = start + offs_n
    keys_ok = keys < seq_len
    k = load_tile(k_ptrs + start * stride_km, keys_ok, d_qk_ok, MASKED, CHECK_QK)
    v = load_tile(v_ptrs + start * stride_vm, keys_ok, d_v_ok, MASKED, CHECK_V)
    s = dot(q, tl.trans(k), None, IEEE, INTERP)
    silu, grad = silu_and_grad(s, alpha, SILU)
    if COMPUTE_DQ:
        w = dot(do, tl.trans(v), None, IEEE, INTERP) * grad
        rhs = k
    else:
        w = silu
        rhs = v
    if MASKED:
        w = tl.where(allowed(queries[:, None], keys[None, :], history_len, max_attn_len, HAS_WINDOW), w, 0.0)
    return dot(cast(w, rhs.dtype, INTERP), rhs, acc, IEEE, INTERP)


@triton.jit
def query_major_kernel(
    Q, K, V, DO, OUT, SEQ_OFFSETS, NUM_TARGETS, COUNTER,
    stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh,
    stride_dom, stride_doh, stride_om, stride_oh,
    num_seqs, num_heads, alpha, out_scale, max_attn_len, AUTOTUNE_N,
    DQK: tl.constexpr, DV: tl.constexpr, D_OUT: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_OUT: tl.constexpr,
    COMPUTE_DQ: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SILU: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr,
):
    """Forward (``out``) or ``dq`` for every (sequence, head, query block) tile of the queue."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_qk = tl.arange(0, BLOCK_DQK)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_out = tl.arange(0, BLOCK_OUT)
    d_qk_ok = offs_qk < DQK
    d_v_ok = offs_v < DV
    CHECK_QK: tl.constexpr = DQK != BLOCK_DQK
    CHECK_V: tl.constexpr = DV != BLOCK_DV
    tile = tl.atomic_add(COUNTER, 1)
    tiles_before = tile * 0
    for chunk0 in range(0, num_seqs, CHUNK):
        tiles, tiles_end = scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before, BLOCK_M, CHUNK)
        chunk_end = tiles_before + tl.sum(tiles)
        while tile < chunk_end:
            next_tile = tl.atomic_add(COUNTER, 1)  # claimed early: the atomic's latency hides behind this tile
            seq, seq_start, seq_len, head, block, blocks = locate_tile(
                tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, BLOCK_M
            )
            m0 = (blocks - 1 - block) * BLOCK_M  # last rows see the most keys: start them first
            queries = m0 + offs_m
            rows_ok = queries < seq_len
            q_rows = Q + seq_start * stride_qm + head * stride_qh + queries[:, None] * stride_qm
            q = load_tile(q_rows + offs_qk[None, :], rows_ok, d_qk_ok, True, CHECK_QK)
            if COMPUTE_DQ:
                do_rows = DO + seq_start * stride_dom + head * stride_doh + queries[:, None] * stride_dom
                do = load_tile(do_rows + offs_v[None, :], rows_ok, d_v_ok, True, CHECK_V)
            else:
                do = q
            k_ptrs = K + seq_start * stride_km + head * stride_kh + offs_n[:, None] * stride_km + offs_qk[None, :]
            v_ptrs = V + seq_start * stride_vm + head * stride_vh + offs_n[:, None] * stride_vm + offs_v[None, :]
            history_len = history_length(NUM_TARGETS, seq, seq_len, HAS_TARGETS)
            full_lo, full_hi, left, diag_lo, n_left, n_hist, n_diag = _query_block_ranges(
                m0, seq_len, history_len, max_attn_len, HAS_WINDOW, BLOCK_M, BLOCK_N
            )
            acc = tl.zeros([BLOCK_M, BLOCK_OUT], dtype=tl.float32)
            for start in range(full_lo, full_hi, BLOCK_N):
                acc = _query_block_step(
                    acc, q, do, k_ptrs, v_ptrs, start, stride_km, stride_vm, queries, offs_n, d_qk_ok,
                    d_v_ok, seq_len, history_len, max_attn_len, alpha, False, COMPUTE_DQ, HAS_WINDOW,
                    SILU, IEEE, INTERP, CHECK_QK, CHECK_V,
                )
            for i in range(0, n_left + n_hist + n_diag):
                start = tl.where(
                    i < n_left,
                    left + i * BLOCK_N,
                    tl.where(i < n_left + n_hist, full_hi + (i - n_left) * BLOCK_N,
                             diag_lo + (i - n_left - n_hist) * BLOCK_N),
                )
                acc = _query_block_step(
                    acc, q, do, k_ptrs, v_ptrs, start, stride_km, stride_vm, queries, offs_n, d_qk_ok,
                    d_v_ok, seq_len, history_len, max_attn_len, alpha, True, COMPUTE_DQ, HAS_WINDOW,
                    SILU, IEEE, INTERP, CHECK_QK, CHECK_V,
                )
            out_ptrs = (OUT + seq_start * stride_om + head * stride_oh + queries[:, None] * stride_om
                        + offs_out[None, :])
            out_mask = rows_ok[:, None] & (offs_out < D_OUT)[None, :]
            tl.store(out_ptrs, cast(acc * out_scale, OUT.dtype.element_ty, INTERP), mask=out_mask)
            tile = next_tile
        tiles_before = chunk_end


TUNERS: dict[tuple[bool, bool], object] = {}


def _tuner(wide: bool, compute_dq: bool) -> object:
    if (wide, compute_dq) not in TUNERS:
        TUNERS[wide, compute_dq] = triton.autotune(
            configs=make_configs(wide, compute_dq), key=["AUTOTUNE_N", "DQK", "DV"], reset_to_zero=["COUNTER"]
        )(query_major_kernel)
    return TUNERS[wide, compute_dq]


def autotune_bucket(max_seq_len: int) -> int:
    return max(16, triton.next_power_of_2(max(1, max_seq_len)))


def query_major(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor | None,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    *,
    max_seq_len: int,
    alpha: float,
    max_attn_len: int,
    blocks: tuple[int, int] | None = None,
) -> torch.Tensor:
    """The forward output, or ``dq`` when ``grad_out`` is given. Inputs have unit last-dim stride."""
    num_rows, num_heads, dim_qk = q.shape
    dim_v = v.shape[-1]
    compute_dq = grad_out is not None
    dim_out = dim_qk if compute_dq else dim_v
    out = torch.empty((num_rows, num_heads, dim_out), dtype=q.dtype if compute_dq else v.dtype, device=q.device)
    num_seqs = seq_offsets.numel() - 1
    if num_rows == 0 or num_seqs <= 0:
        return out
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    do = grad_out if grad_out is not None else q
    scale = (alpha if compute_dq else 1.0) / max_seq_len
    wide = max(dim_qk, dim_v) > 128
    bucket = autotune_bucket(max_seq_len)

    def grid(meta: dict) -> tuple[int]:
        bound = num_seqs * num_heads * triton.cdiv(max(max_seq_len, 1), meta["BLOCK_M"])
        return (num_programs(q.device, meta["PROGRAMS_PER_SM"], bound),)

    args = (
        q, k, v, do, out, seq_offsets, num_targets if num_targets is not None else seq_offsets, counter,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        do.stride(0), do.stride(1), out.stride(0), out.stride(1),
        num_seqs, num_heads, alpha, scale, max_attn_len, bucket,
    )
    meta = dict(
        DQK=dim_qk, DV=dim_v, D_OUT=dim_out, BLOCK_DQK=dim_block(dim_qk), BLOCK_DV=dim_block(dim_v),
        BLOCK_OUT=dim_block(dim_out), COMPUTE_DQ=compute_dq, HAS_TARGETS=num_targets is not None,
        HAS_WINDOW=max_attn_len > 0, SILU=silu_mode(q.dtype), IEEE=q.dtype == torch.float32,
        INTERP=INTERPRET, CHUNK=CHUNK,
    )
    with device_guard(q.device):
        if blocks is not None:
            fixed = dict(BLOCK_M=blocks[0], BLOCK_N=blocks[1], PROGRAMS_PER_SM=1)
            warps = fixed_block_warps(*blocks)
            query_major_kernel[grid](*args, **meta, **fixed, num_warps=warps, num_stages=2)  # type: ignore[index]
        else:
            tuner = _tuner(wide, compute_dq)
            launch_once_tuned(tuner, lambda: tuner[grid](*args, **meta), [counter])  # type: ignore[index]
    return out
