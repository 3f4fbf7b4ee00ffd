"""Jagged HSTU attention in Triton: the forward pass and the query-major ``dq`` pass.

Operation
---------
Rows ``seq_offsets[b] : seq_offsets[b + 1]`` of ``q, k`` ``[L, H, Dqk]`` and ``v`` ``[L, H, Dv]`` form
sequence ``b`` of length ``n``; ``t = num_targets[b]`` (0 without targets), ``N = max_seq_len``,
``W = max_attn_len``. With positions local to the sequence and ``p(i) = min(i, n - t)``::

    out[i, h] = sum_j mask(i, j) * silu(alpha * <q[i, h], k[j, h]>) / N * v[j, h]
    mask(i, j) = (i == j) or (0 < p(i) - p(j) and (W == 0 or p(i) - p(j) <= W))

No term crosses sequences. With HSTU's relative biases, ``r(i, j)`` joins the score before the silu
(:mod:`gem_kernels.attention_triton_bias`). Gradients (``s = alpha <q_i, k_j> + r(i, j)``, ``g = d out``)::

    dv[j] = sum_i mask * silu(s) / N * g[i]
    ds    = mask * <g[i], v[j]> * silu'(s) / N
    dq[i] = alpha * sum_j ds * k[j],   dk[j] = alpha * sum_i ds * q[i],   d r(i, j) = ds

Design
------
* One tile = (sequence, head, block of ``BLOCK_M`` query rows). Tiles live in a queue ordered by
  sequence, head, then block (longest-running block first); a persistent grid of
  ``programs_per_sm x SMs`` programs claims them with an atomic counter. The queue is never
  materialised: each program scans ``seq_offsets`` a chunk at a time, so no host sync, no padded
  grid, and no program is spent on padding. The last program to finish zeroes the counter again,
  so one counter per (device, stream) serves every launch, without a memset per call.
* Tuning: each kernel (forward, dq, dk/dv, dk/dv with atomic dq) picks its config once per key
  (dtype, head dims, targets, window, ``max_seq_len`` and mean length ``L / B``, each rounded up to
  a power of two) by timing every candidate on that call's inputs. The mean length splits batches
  of short sequences from long ones with the same ``max_seq_len``: at N = 1024, s = 0.3 (mean 302)
  a smaller query block wastes less of each sequence's padded last block than at s = 0.95.
* Launching: after its first launch (through ``kernel[grid](...)``, which compiles), a
  (config, argument specialisation) is launched straight through its compiled kernel, skipping
  Triton's autotuner and JIT dispatch (``TunedKernel`` in ``launcher``). On small
  batches the host's work is the cost of a call: ~200-400 us per forward before (Triton's
  autotuner, JIT binding, a counter memset), ~40-60 us after, on a loaded 2-core CPU; the
  MovieLens-like case (16k rows) took 0.173 ms per forward on the H200 for a few us of math.
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

from gem_kernels import attention_gluon
from gem_kernels.attention_triton_bias import NO_BIAS, RelativeBias, relative_bias
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

# (BLOCK_M, BLOCK_N, num_warps, num_stages, programs per SM) for Hopper-class GPUs. Each is a compile
# of a large kernel, so few. From ptxas reports for sm_90 at head dim 128 (compile_report): these stay
# within 255 registers without spilling (the 128 x 128 forward spills ~100 bytes; its larger key block
# halves the shared-memory reads of q k^T, so it stays a candidate). 8-warp tiles take a whole SM's
# registers; the 4-warp ones leave registers and shared memory for two programs per SM, whose
# per-tile latency (claim, locate, first loads, store) then hides behind the other program's math,
# which pays on short sequences (few key blocks per tile), as do their smaller query blocks (less of
# each sequence's last block is padding). The 2026-11-30 H200 run chose (64, 32, 4, 3, 2) for the dq
# pass at N = 256 and 1024, so both 4-warp shapes are candidates for the forward too.
FORWARD_CONFIGS: list[Config] = [
    (128, 128, 8, 2, 1), (128, 64, 8, 2, 1), (128, 64, 8, 3, 1), (128, 64, 8, 4, 1),
    (64, 64, 4, 2, 2), (64, 64, 4, 3, 2), (64, 32, 4, 3, 2), (64, 32, 4, 3, 3),
]
# The dq pass's (64, 64, 4, 2, 2) and (128, 64, 8, 4, 1): the tuner's own timings on the H200 (2026-12-04,
# descriptor loads) put them first at N = 1024 uniform (2.104 against 2.158 ms), N = 1024 s = 0.3 (0.417
# against 0.433) and N = 4096 uniform (24.77 against 25.44); on the big config's lengths 2.981 against 2.990.
DQ_CONFIGS: list[Config] = [
    (128, 64, 8, 2, 1), (128, 64, 8, 3, 1), (128, 64, 8, 4, 1), (128, 32, 8, 3, 1), (64, 64, 4, 2, 2),
    (64, 32, 4, 3, 2), (64, 32, 4, 2, 2), (64, 32, 4, 4, 2),
]
WIDE_CONFIGS: list[Config] = [(128, 32, 8, 2, 1), (64, 64, 8, 2, 1), (32, 64, 4, 2, 2)]  # head dims above 128
INTERPRETER_CONFIGS: list[Config] = [(16, 16, 1, 1, 1)]


def make_configs(wide: bool, compute_dq: bool) -> list[Config]:
    if INTERPRET:
        return INTERPRETER_CONFIGS
    return WIDE_CONFIGS if wide else (DQ_CONFIGS if compute_dq else FORWARD_CONFIGS)


KEY_NAMES = ("dtype", "dqk", "dv", "targets", "window", "bias", "chunk", "blocks", "loads", "n_bucket", "mean_bucket")
"""What a tuning key holds: ``bias`` the relative biases (``RelativeBias.label``), ``blocks`` is
``auto`` (tuned) or the tile sizes set by hand, ``loads`` ``tma`` (the tiles that the inner loop
walks come by tensor descriptors: :func:`~gem_kernels.attention_triton_common.tma_loads`) or
``pointers``."""


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
                      PB, TB, EDGES, key_times, query_t, pos_offset, num_buckets, key_scale_ptrs, stride_scale,
                      k_desc, v_desc, key_row, k_col, v_col,
                      MASKED: tl.constexpr, COMPUTE_DQ: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr,
                      SILU: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr,
                      CHECK_QK: tl.constexpr, CHECK_V: tl.constexpr, FP8: tl.constexpr, TMA: tl.constexpr):
    keys = start + offs_n
    keys_ok = keys < seq_len
    if TMA:
        # whole tiles by the tensor memory accelerator: rows past the sequence are the next sequence's
        # (zeros past the tensor); only MASKED steps reach them, and their scores are masked below
        k = k_desc.load([key_row + start, k_col])
        v = v_desc.load([key_row + start, v_col])
    else:
        k = load_tile(k_ptrs + start * stride_km, keys_ok, d_qk_ok, MASKED, CHECK_QK)
        v = load_tile(v_ptrs + start * stride_vm, keys_ok, d_v_ok, MASKED, CHECK_V)
    s = dot(q, tl.trans(k), None, IEEE, INTERP)
    if FP8:  # e4m3 q k^T: the keys' dequantization factors here, the queries' are in ``alpha``
        if MASKED:
            s *= tl.load(key_scale_ptrs + start * stride_scale, mask=keys_ok, other=0.0)[None, :]
        else:
            s *= tl.load(key_scale_ptrs + start * stride_scale)[None, :]
    if HAS_POS or HAS_TIME:
        key_t = keys
        if HAS_TIME:
            if MASKED:
                key_t = tl.load(key_times + keys, mask=keys_ok, other=0)
            else:
                key_t = tl.load(key_times + keys)
        r, _ = relative_bias(PB, TB, EDGES, queries[:, None], keys[None, :], query_t[:, None], key_t[None, :],
                             pos_offset, num_buckets, HAS_POS, HAS_TIME)
        silu, grad = silu_and_grad_biased(s, alpha, r, SILU)
    else:
        silu, grad = silu_and_grad(s, alpha, SILU)
    if COMPUTE_DQ:
        w = dot(do, tl.trans(v), None, IEEE, INTERP) * grad
        rhs = k
    else:
        w = silu
        rhs = v
    if MASKED:
        keep = allowed(queries[:, None], keys[None, :], history_len, max_attn_len, HAS_WINDOW)
        if TMA:  # no valid row sees a key past its sequence, but say so: those are the next sequence's
            keep &= keys_ok[None, :]
        w = tl.where(keep, w, 0.0)
    return dot(cast(w, rhs.dtype, INTERP), rhs, acc, IEEE, INTERP)


# no recompiles for B = 1, H = 1, W = 1, nor per max_seq_len or bucket count
@triton.jit(do_not_specialize=["num_seqs", "num_heads", "num_rows", "max_attn_len", "pos_offset", "num_buckets"])
def query_major_kernel(
    Q, K, V, DO, OUT, SEQ_OFFSETS, NUM_TARGETS, COUNTER, PB, TB, EDGES, TS, QTS,
    stride_qm, stride_qh, stride_km, stride_kh, stride_vm, stride_vh,
    stride_dom, stride_doh, stride_om, stride_oh,
    num_seqs, num_heads, num_rows, alpha, out_scale, max_attn_len, pos_offset, num_buckets,
    DQK: tl.constexpr, DV: tl.constexpr, D_OUT: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_OUT: tl.constexpr,
    COMPUTE_DQ: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_POS_BIAS: tl.constexpr, HAS_TIME_BIAS: tl.constexpr,
    SILU: tl.constexpr, IEEE: tl.constexpr, INTERP: tl.constexpr, CHUNK: tl.constexpr, FP8: tl.constexpr,
    TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PROGRAMS_PER_SM: tl.constexpr,
):
    """Forward (``out``) or ``dq`` for every (sequence, head, query block) tile of the queue. ``PB``,
    ``TB``: position and time bias tables; ``EDGES``: the time buckets' edge table; ``TS``, ``QTS``:
    int64 key and query timestamps; ``pos_offset = max_seq_len - 1`` (all unused without a bias).
    ``TMA``: the key and value tiles come by tensor descriptors over ``[num_rows, num_heads * D]``
    (the caller checks heads are contiguous, rows 16-byte aligned, and the head dims unpadded)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_qk = tl.arange(0, BLOCK_DQK)
    offs_v = tl.arange(0, BLOCK_DV)
    offs_out = tl.arange(0, BLOCK_OUT)
    d_qk_ok = offs_qk < DQK
    d_v_ok = offs_v < DV
    CHECK_QK: tl.constexpr = DQK != BLOCK_DQK
    CHECK_V: tl.constexpr = DV != BLOCK_DV
    k_desc = K  # unused without TMA
    v_desc = V
    if TMA:
        k_desc = row_descriptor(K, num_rows, num_heads * DQK, stride_km, BLOCK_N, BLOCK_DQK)
        v_desc = row_descriptor(V, num_rows, num_heads * DV, stride_vm, BLOCK_N, BLOCK_DV)
    tile = tl.atomic_add(COUNTER, 1, sem="relaxed")
    tiles_before = tile * 0
    for chunk0 in range(0, num_seqs, CHUNK):
        tiles, tiles_end = scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before, BLOCK_M, CHUNK)
        chunk_end = tiles_before + tl.sum(tiles)
        while tile < chunk_end:
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
            row_alpha = alpha
            key_scales = DO  # unused unless FP8
            if FP8:  # DO holds the dequantization factors [L, H, 2]: q's at 0, k's at 1
                scale_rows = DO + seq_start * stride_dom + head * stride_doh
                row_alpha = alpha * tl.load(scale_rows + queries * stride_dom, mask=rows_ok, other=0.0)[:, None]
                key_scales = scale_rows + 1 + offs_n * stride_dom
            history_len = history_length(NUM_TARGETS, seq, seq_len, HAS_TARGETS)
            key_times = TS
            query_t = queries
            if HAS_TIME_BIAS:
                key_times = TS + seq_start
                query_t = tl.load(QTS + seq_start + queries, mask=rows_ok, other=0)
            k_ptrs = K + seq_start * stride_km + head * stride_kh + offs_n[:, None] * stride_km + offs_qk[None, :]
            v_ptrs = V + seq_start * stride_vm + head * stride_vh + offs_n[:, None] * stride_vm + offs_v[None, :]
            # The next tile. Relaxed: only atomicity matters, and acq_rel made each claim wait for the
            # previous tile's output stores to drain. Triton hands a scalar atomic's result to every
            # thread through shared memory behind a barrier, so the program waits for the round trip
            # wherever it claims: here, at least, with this tile's targets load in flight.
            next_tile = tl.atomic_add(COUNTER, 1, sem="relaxed")
            full_lo, full_hi, left, diag_lo, n_left, n_hist, n_diag = _query_block_ranges(
                m0, seq_len, history_len, max_attn_len, HAS_WINDOW, BLOCK_M, BLOCK_N
            )
            acc = tl.zeros([BLOCK_M, BLOCK_OUT], dtype=tl.float32)
            for start in range(full_lo, full_hi, BLOCK_N):
                acc = _query_block_step(
                    acc, q, do, k_ptrs, v_ptrs, start, stride_km, stride_vm, queries, offs_n, d_qk_ok,
                    d_v_ok, seq_len, history_len, max_attn_len, row_alpha, PB, TB, EDGES, key_times, query_t,
                    pos_offset, num_buckets, key_scales, stride_dom, k_desc, v_desc, seq_start.to(tl.int32), head * DQK, head * DV,
                    False, COMPUTE_DQ, HAS_WINDOW, HAS_POS_BIAS, HAS_TIME_BIAS, SILU, IEEE, INTERP, CHECK_QK,
                    CHECK_V, FP8, TMA,
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
                    d_v_ok, seq_len, history_len, max_attn_len, row_alpha, PB, TB, EDGES, key_times, query_t,
                    pos_offset, num_buckets, key_scales, stride_dom, k_desc, v_desc, seq_start.to(tl.int32), head * DQK, head * DV,
                    True, COMPUTE_DQ, HAS_WINDOW, HAS_POS_BIAS, HAS_TIME_BIAS, SILU, IEEE, INTERP, CHECK_QK,
                    CHECK_V, FP8, TMA,
                )
            out_ptrs = (OUT + seq_start * stride_om + head * stride_oh + queries[:, None] * stride_om
                        + offs_out[None, :])
            out_mask = rows_ok[:, None] & (offs_out < D_OUT)[None, :]
            tl.store(out_ptrs, cast(acc * out_scale, OUT.dtype.element_ty, INTERP), mask=out_mask)
            tile = next_tile
        tiles_before = chunk_end
    release_queue(COUNTER)


_POINTERS = ("Q", "K", "V", "DO", "OUT", "SEQ_OFFSETS", "NUM_TARGETS", "COUNTER", "PB", "TB", "EDGES", "TS", "QTS")
FORWARD = TunedKernel("forward", query_major_kernel, pointers=_POINTERS, floats=("alpha", "out_scale"),
                      key_names=KEY_NAMES)
DQ = TunedKernel("dq", query_major_kernel, pointers=_POINTERS, floats=("alpha", "out_scale"),
                 key_names=KEY_NAMES)


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
    bias: RelativeBias = NO_BIAS,
    out: torch.Tensor | None = None,
    fp8_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The forward output, or ``dq`` when ``grad_out`` is given. Inputs have unit last-dim stride;
    ``bias`` comes from :func:`gem_kernels.attention_triton_bias.prepare_bias`. ``out``: where to
    write it (``[L, H, D]``, any row and head strides, unit last stride), else a new tensor.

    ``fp8_scales`` (forward only): ``q`` and ``k`` are ``float8_e4m3fn`` and stand for ``q * fp8_scales[...,
    0, None]`` and ``k * fp8_scales[..., 1, None]`` (float32 ``[L, H, 2]``, unit last stride; written by
    :mod:`gem_kernels.attention_fp8`); ``v`` stays in the activation dtype. The kernel reads them through
    its ``DO`` pointer, which the forward does not otherwise use: so the default path's signature, and
    its compiled code, are those of the kernel without the fp8 mode."""
    num_rows, num_heads, dim_qk = q.shape
    dim_v = v.shape[2]
    compute_dq = grad_out is not None
    fp8 = fp8_scales is not None
    if fp8 and (compute_dq or q.dtype != torch.float8_e4m3fn or k.dtype != torch.float8_e4m3fn
                or fp8_scales.shape != (num_rows, num_heads, 2) or fp8_scales.dtype != torch.float32
                or fp8_scales.stride(-1) != 1):  # fmt: skip
        raise ValueError(
            f"query_major: fp8_scales is for the forward of float8_e4m3fn q, k and needs float32 [{num_rows}, "
            f"{num_heads}, 2]; got q {q.dtype}, k {k.dtype}, scales {fp8_scales.dtype} {tuple(fp8_scales.shape)}, "
            f"grad_out {'given' if compute_dq else 'None'}"
        )
    dim_out = dim_qk if compute_dq else dim_v
    if (attention_gluon.FORWARD and not compute_dq and not fp8 and blocks is None and max_attn_len <= 0
            and bias.position is None and bias.time is None and attention_gluon.supported(q, k, v)):  # fmt: skip
        return attention_gluon.forward(q, k, v, seq_offsets, num_targets, max_seq_len=max_seq_len, alpha=alpha, out=out)
    if (attention_gluon.DQ and compute_dq and blocks is None and max_attn_len <= 0 and bias.position is None
            and bias.time is None and attention_gluon.supported(q, k, v, grad_out)):  # fmt: skip
        return attention_gluon.dq(q, k, v, grad_out, seq_offsets, num_targets, max_seq_len=max_seq_len, alpha=alpha,
                                  out=out)  # fmt: skip
    if out is None:
        out = torch.empty((num_rows, num_heads, dim_out), dtype=q.dtype if compute_dq else v.dtype, device=q.device)
    num_seqs = seq_offsets.shape[0] - 1
    if num_rows == 0 or num_seqs <= 0:
        return out
    device = q.device
    do = grad_out if grad_out is not None else (fp8_scales if fp8_scales is not None else q)
    alpha = float(alpha)
    scale = (alpha if compute_dq else 1.0) / max_seq_len
    has_targets = num_targets is not None
    has_window = max_attn_len > 0
    chunk = CHUNK  # read at call time: tests shrink it
    tma = not fp8 and tma_loads(k, v)
    variant = (q.dtype, dim_qk, dim_v, has_targets, has_window, bias.label(), chunk,
               "auto" if blocks is None else blocks,  # q.dtype: float8_e4m3fn for the fp8 forward
               "tma" if tma else "pointers")

    def constexprs() -> dict:
        return dict(
            DQK=dim_qk, DV=dim_v, D_OUT=dim_out, BLOCK_DQK=dim_block(dim_qk), BLOCK_DV=dim_block(dim_v),
            BLOCK_OUT=dim_block(dim_out), COMPUTE_DQ=compute_dq, HAS_TARGETS=has_targets, HAS_WINDOW=has_window,
            HAS_POS_BIAS=bias.position is not None, HAS_TIME_BIAS=bias.time is not None,
            SILU=silu_mode(v.dtype), IEEE=v.dtype == torch.float32, INTERP=INTERPRET, CHUNK=chunk, FP8=fp8,
            TMA=tma,
        )

    def tile_bound(config: Config) -> int:
        return num_seqs * num_heads * -(-max(max_seq_len, 1) // config[0])

    with device_guard(device):
        counter = queue_counter(device)
        args = (
            q, k, v, do, out, seq_offsets, num_targets if num_targets is not None else seq_offsets, counter,
            *bias.pointers(q), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            do.stride(0), do.stride(1), out.stride(0), out.stride(1),
            num_seqs, num_heads, num_rows, alpha, scale, max_attn_len, max_seq_len - 1, bias.num_buckets,
        )
        if blocks is not None:
            configs = [fixed_config(*blocks)]
            buckets: tuple[int, int] = (0, 0)
        else:
            configs = make_configs(max(dim_qk, dim_v) > 128, compute_dq)
            buckets = length_buckets(max_seq_len, num_rows, num_seqs)
        (DQ if compute_dq else FORWARD).launch(
            args, constexprs, variant=variant, buckets=buckets, configs=configs, device=device,
            tile_bound=tile_bound,
        )
    return out
