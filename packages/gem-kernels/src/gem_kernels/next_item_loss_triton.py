"""The next-item sampled softmax with shared negatives in Triton (imports triton).

The math is :mod:`gem_model.model.next_item`'s: row ``i`` of a history (every row but its sequence's
last) has query ``q_i``, positive ``p = items[i + 1]`` (cast to the query's dtype) and its sequence's
``K`` negatives ``n_k``; with ``u(x) = x / max(|x|, eps)`` under ``l2_normalize``::

    s_0 = u(q) . u(p),  s_k = u(q) . u(n_k)  (-inf where n_k is the positive item)
    loss_i = logsumexp(s / T) - s_0 / T

Three kernels, over tiles of ``BLOCK_M`` (32) rows of one sequence (a tile never crosses sequences):

* forward: one pass over ``D`` multiplies the tile's queries with the sequence's negatives (``[BLOCK_M,
  K]`` fp32 scores in registers) and sums ``q . p``, ``|q|^2`` and ``|p|^2`` on the way; the softmax
  follows in registers. It stores per row the loss, the log-sum-exp, ``s_0`` and the two norms.
* rows backward: the same scores again (queries and negatives only), the score gradients from the
  saved log-sum-exp, then a second pass over ``D`` writing the gradients of the queries and of the
  positives (``a p - c q`` and ``a q - e p`` with per-row ``a, c, e``, besides ``G U`` for the
  queries) and the score gradients ``G`` (``[L, K]``, query dtype) for the next kernel.
* negatives backward: per sequence and column block, ``G^T q`` summed over the sequence's tiles (no
  atomics: one program owns each output block).

Rows that predict nothing (each sequence's last) get zero gradients and zero loss, and the first row
of each sequence a zero item gradient, so every output is written by a kernel (no memset).
Under ``l2_normalize`` the negatives are normalised and cast by torch (``[B, K, D]`` is small next to
the rows), or, with :data:`UNIT_ROWS_KERNEL`, by one pass of :mod:`gem_kernels.unit_rows_triton`, which
another takes the gradient back through.
Determinism: with 64-row tiles and bf16 operands Triton 3.6 gave run-to-run different scores on the
H200 (per-row log-sum-exps off by up to ~1e-3 in ~3.5 % of the rows, 2026-12-03; float32 operands made
it deterministic but 1.5x slower). With 32-row tiles and bf16 operands six calls on each of two inputs
gave the same bits (2026-12-04); ``benchmarks/next_item_kernel.py`` exits unless two calls agree bit for
bit, and a CI test runs the kernel twice under the interpreter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard, dim_block, dot
from gem_kernels.unit_rows_triton import unit_rows_triton, unit_rows_vjp_triton
from gem_model.api import L2_EPS, GradSection, grad_section, offsets_of, to_device_async, unit_rows, unit_rows_vjp

BLOCK_M = 32
"""Rows of one sequence per tile. 32 rather than 64: half the histories are shorter than ~80 rows, so
64-row tiles were up to half padding. On the H200 (2026-12-04, forward and backward) 32 x 64 on 4
warps took 4.58 against 5.30 ms at 64 rows (big config) and 5.10 against 5.97 ms (second mix) with
float32 operands (``benchmarks/next_item_kernel.py --tiles``), and 3.93 / 3.90 ms with bf16 operands,
deterministic (module docstring)."""
BLOCK_D = 64
"""Columns per step of the passes over ``D``."""
UNIT_ROWS_KERNEL = True
"""Whether the shared negatives are normalised, and their gradient taken back, by
:mod:`gem_kernels.unit_rows_triton` (one pass each way) instead of torch's seven float32 passes (read at
call time; e2e switch ``torch_unit_rows`` gives torch's back). 0.207 against 1.849 ms a step's worth on the
H100 (``benchmarks/reduction_passes.py``, 2026-12-06); on since then."""


def _warps(block_k: int) -> int:
    """One warpgroup up to 128 negatives (the tiles measured and checked deterministic), two beyond."""
    return 1 if INTERPRET else (8 if block_k > 128 else 4)


@triton.jit
def _tile(TILE_SEQ, TILE_ROW, OFFSETS, BLOCK_M: tl.constexpr):
    """A tile's sequence, its rows, which of them predict (every row but the sequence's last) and
    which lie in the sequence."""
    t = tl.program_id(0)
    b = tl.load(TILE_SEQ + t)
    first = tl.load(OFFSETS + b)
    last = tl.load(OFFSETS + b + 1) - 1
    rows = tl.load(TILE_ROW + t) + tl.arange(0, BLOCK_M).to(tl.int64)
    return b, first, rows, rows < last, rows <= last


@triton.jit
def _scores(Q, U, b, rows, pred, stride_q, D, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
            BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    """``q . n_k`` of the tile's rows (fp32 ``[BLOCK_M, BLOCK_K]``), zero for rows that predict nothing."""
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        c_ok = cols < D
        q = tl.load(Q + rows[:, None] * stride_q + cols[None, :], mask=pred[:, None] & c_ok[None, :], other=0.0)
        u = tl.load(U + (b * K + ks)[:, None] * D + cols[None, :], mask=(ks < K)[:, None] & c_ok[None, :], other=0.0)
        acc = dot(q, tl.trans(u), acc, False, INTERP)
    return acc


@triton.jit
def _operands(Q, P, U, b, rows, pred, d0, stride_q, stride_p, D, K, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
              INTERP: tl.constexpr):
    """Columns ``d0 : d0 + BLOCK_D`` of the tile's queries, their positives (cast to the query's dtype)
    and the sequence's negatives, zero where masked; and which columns exist."""
    ks = tl.arange(0, BLOCK_K)
    cols = d0 + tl.arange(0, BLOCK_D)
    c_ok = cols < D
    both = pred[:, None] & c_ok[None, :]
    q = tl.load(Q + rows[:, None] * stride_q + cols[None, :], mask=both, other=0.0)
    p = tl.load(P + (rows + 1)[:, None] * stride_p + cols[None, :], mask=both, other=0.0)
    p = cast(p.to(tl.float32), Q.dtype.element_ty, INTERP)  # the positive in the query's dtype
    u = tl.load(U + (b * K + ks)[:, None] * D + cols[None, :], mask=(ks < K)[:, None] & c_ok[None, :], other=0.0)
    return cols, c_ok, q, p, u


@triton.jit
def _logits(acc, q_norm, b, rows, pred, NEG_ID, ITEM_ID, K, inv_t, eps, L2: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """The negatives' logits ``s_k / T`` (-inf where masked), the scores ``s_k`` and the hit mask."""
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    s = acc
    if L2:
        s = acc / tl.maximum(q_norm, eps)[:, None]
    neg_id = tl.load(NEG_ID + b * K + ks, mask=k_ok, other=0)
    pos_id = tl.load(ITEM_ID + rows + 1, mask=pred, other=0)
    off = (neg_id[None, :] == pos_id[:, None]) | (~k_ok)[None, :]
    return tl.where(off, float("-inf"), s * inv_t), s, off


@triton.jit
def _loss_fwd(Q, P, U, NEG_ID, ITEM_ID, OFFSETS, TILE_SEQ, TILE_ROW, LOSS, LSE, S0, QN, PN,
              stride_q, stride_p, D, K, inv_t, eps, L2: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    b, _, rows, pred, inside = _tile(TILE_SEQ, TILE_ROW, OFFSETS, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    qp = tl.zeros([BLOCK_M], dtype=tl.float32)
    qq = tl.zeros([BLOCK_M], dtype=tl.float32)
    pp = tl.zeros([BLOCK_M], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        q, p, u = _operands(Q, P, U, b, rows, pred, d0, stride_q, stride_p, D, K, BLOCK_K, BLOCK_D, INTERP)[2:]
        acc = dot(q, tl.trans(u), acc, False, INTERP)
        qf, pf = q.to(tl.float32), p.to(tl.float32)
        qp += tl.sum(qf * pf, 1)
        qq += tl.sum(qf * qf, 1)
        pp += tl.sum(pf * pf, 1)
    q_norm, p_norm = tl.sqrt(qq), tl.sqrt(pp)
    s0 = qp
    if L2:
        s0 = qp / tl.maximum(q_norm, eps) / tl.maximum(p_norm, eps)
    z = _logits(acc, q_norm, b, rows, pred, NEG_ID, ITEM_ID, K, inv_t, eps, L2, BLOCK_K)[0]
    z0 = s0 * inv_t
    m = tl.maximum(tl.max(z, 1), z0)
    lse = m + tl.log(tl.sum(tl.exp(z - m[:, None]), 1) + tl.exp(z0 - m))
    tl.store(LOSS + rows, tl.where(pred, lse - z0, 0.0), mask=inside)
    tl.store(LSE + rows, lse, mask=pred)
    tl.store(S0 + rows, s0, mask=pred)
    tl.store(QN + rows, q_norm, mask=pred)
    tl.store(PN + rows, p_norm, mask=pred)


@triton.jit
def _loss_bwd_rows(Q, P, U, NEG_ID, ITEM_ID, OFFSETS, TILE_SEQ, TILE_ROW, LSE, S0, QN, PN, GRAD, GQ, GP, GS,
                   stride_q, stride_p, stride_gq, stride_gp, D, K, inv_t, eps, L2: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    b, first, rows, pred, inside = _tile(TILE_SEQ, TILE_ROW, OFFSETS, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = _scores(Q, U, b, rows, pred, stride_q, D, K, BLOCK_M, BLOCK_K, BLOCK_D, INTERP)
    lse = tl.load(LSE + rows, mask=pred, other=0.0)
    s0 = tl.load(S0 + rows, mask=pred, other=0.0)
    q_norm = tl.load(QN + rows, mask=pred, other=1.0)
    p_norm = tl.load(PN + rows, mask=pred, other=1.0)
    z, s, off = _logits(acc, q_norm, b, rows, pred, NEG_ID, ITEM_ID, K, inv_t, eps, L2, BLOCK_K)
    grad = tl.load(GRAD).to(tl.float32) * inv_t
    g = tl.where(pred[:, None] & ~off, grad * tl.exp(z - lse[:, None]), 0.0)  # d loss / d s_k
    g0 = tl.where(pred, grad * (tl.exp(s0 * inv_t - lse) - 1.0), 0.0)  # d loss / d s_0
    if L2:  # s_k = (q . u_k) / |q|, s_0 = (q . p) / (|q| |p|): the norms' terms are per-row scalars
        q_scale, p_scale = 1.0 / tl.maximum(q_norm, eps), 1.0 / tl.maximum(p_norm, eps)
        along = tl.sum(tl.where(off, 0.0, g * s), 1) + g0 * s0
        a = g0 * q_scale * p_scale
        c = tl.where(q_norm >= eps, along * q_scale * q_scale, 0.0)
        e = tl.where(p_norm >= eps, g0 * s0 * p_scale * p_scale, 0.0)
        g = g * q_scale[:, None]  # the gradient of q . u_k
    else:
        a, c, e = g0, tl.zeros_like(g0), tl.zeros_like(g0)
    g = cast(g, GS.dtype.element_ty, INTERP)
    tl.store(GS + rows[:, None] * K + ks[None, :], g, mask=inside[:, None] & (ks < K)[None, :])
    for d0 in range(0, D, BLOCK_D):
        cols, c_ok, q, p, u = _operands(Q, P, U, b, rows, pred, d0, stride_q, stride_p, D, K, BLOCK_K, BLOCK_D, INTERP)
        qf, pf = q.to(tl.float32), p.to(tl.float32)
        both = pred[:, None] & c_ok[None, :]
        gq = dot(g, u, tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), False, INTERP)
        gq += a[:, None] * pf - c[:, None] * qf
        tl.store(GQ + rows[:, None] * stride_gq + cols[None, :], cast(gq, GQ.dtype.element_ty, INTERP),
                 mask=inside[:, None] & c_ok[None, :])
        gp = a[:, None] * qf - e[:, None] * pf
        tl.store(GP + (rows + 1)[:, None] * stride_gp + cols[None, :], cast(gp, GP.dtype.element_ty, INTERP),
                 mask=both)
        tl.store(GP + rows[:, None] * stride_gp + cols[None, :], tl.zeros_like(gp).to(GP.dtype.element_ty),
                 mask=(rows == first)[:, None] & c_ok[None, :])  # the sequence's first item predicts nothing


@triton.jit
def _loss_bwd_negatives(Q, GS, OFFSETS, GU, stride_q, D, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                        BLOCK_D: tl.constexpr, INTERP: tl.constexpr):
    b = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_ok = cols < D
    ks = tl.arange(0, BLOCK_K)
    k_ok = ks < K
    start = tl.load(OFFSETS + b)
    end = tl.load(OFFSETS + b + 1)
    acc = tl.zeros([BLOCK_K, BLOCK_D], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M).to(tl.int64)
        ok = rows < end
        g = tl.load(GS + rows[:, None] * K + ks[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
        q = tl.load(Q + rows[:, None] * stride_q + cols[None, :], mask=ok[:, None] & c_ok[None, :], other=0.0)
        acc = dot(tl.trans(g), q, acc, False, INTERP)
    tl.store(GU + (b * K + ks)[:, None] * D + cols[None, :], acc, mask=k_ok[:, None] & c_ok[None, :])


def _tiles(host_lengths: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(tile_seq, tile_row)`` int64 on ``device`` (one copy, not waited for) and the number of
    predicted rows: each non-empty sequence in tiles of ``BLOCK_M`` rows from its first."""
    n = host_lengths.to(torch.int64).numpy()
    tiles = -(-n // BLOCK_M)
    seq = np.repeat(np.arange(n.size, dtype=np.int64), tiles)
    within = np.arange(seq.size, dtype=np.int64) - np.repeat(np.cumsum(tiles) - tiles, tiles)
    row = (np.cumsum(n) - n)[seq] + within * BLOCK_M
    packed = to_device_async(torch.from_numpy(np.stack([seq, row])), device)
    return packed[0], packed[1], int(np.maximum(n - 1, 0).sum())


class _SharedNegativesLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, items: torch.Tensor, negatives: torch.Tensor,  # type: ignore[override]
                item_ids: torch.Tensor, negative_ids: torch.Tensor, offsets: torch.Tensor, tile_seq: torch.Tensor,
                tile_row: torch.Tensor, num_negatives: int, l2: bool, temperature: float,
                items_grad: GradSection | None, negatives_grad: GradSection | None) -> torch.Tensor:  # fmt: skip
        rows, dim = query.shape
        k = num_negatives
        b = negatives.shape[0] // k
        norm = None
        if l2 and UNIT_ROWS_KERNEL:  # one pass: the unit rows in the query's dtype and their norms
            u, norm = unit_rows_triton(negatives, query.dtype)
            u = u.reshape(b, k, dim)
        else:
            unit = unit_rows(negatives.float())[0] if l2 else negatives
            u = unit.to(query.dtype).reshape(b, k, dim).contiguous()
        # every output is written by the kernel (no memset; the tests poison fresh memory)
        loss, lse, s0, q_norm, p_norm = (torch.empty(rows, dtype=torch.float32, device=query.device) for _ in range(5))
        block_k = dim_block(k)
        with device_guard(query.device):
            _loss_fwd[(tile_seq.numel(),)](
                query, items, u, negative_ids, item_ids, offsets, tile_seq, tile_row, loss, lse, s0, q_norm, p_norm,
                query.stride(0), items.stride(0), dim, k, 1.0 / temperature, L2_EPS, L2=l2,
                BLOCK_M=BLOCK_M, BLOCK_K=block_k, BLOCK_D=BLOCK_D, INTERP=INTERPRET, num_warps=_warps(block_k),
            )  # fmt: skip
        ctx.save_for_backward(query, items, negatives, u, item_ids, negative_ids, offsets, tile_seq, tile_row,
                              lse, s0, q_norm, p_norm, norm)  # fmt: skip
        ctx.k, ctx.l2, ctx.temperature, ctx.sections = k, l2, temperature, (items_grad, negatives_grad)
        return loss.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        query, items, negatives, u, item_ids, negative_ids, offsets, tile_seq, tile_row, lse, s0, q_norm, p_norm, norm = (
            ctx.saved_tensors
        )
        (rows, dim), k, l2 = query.shape, ctx.k, ctx.l2
        b = negatives.shape[0] // k
        block_k = dim_block(k)
        grad_q = torch.empty_like(query)
        # the positives' and negatives' gradients straight into the lookup's gradient buffer, where their
        # rows are free (gem_model.table_grad); else returned
        claimed_p, claimed_n = (_free(s) for s in ctx.sections)
        grad_p = claimed_p if claimed_p is not None else torch.empty_like(items)
        score_grad = torch.empty((rows, k), dtype=query.dtype, device=query.device)
        grad_unit = torch.empty((b, k, dim), dtype=torch.float32, device=query.device)
        grad = grad.float().reshape(1).contiguous()
        with device_guard(query.device):
            _loss_bwd_rows[(tile_seq.numel(),)](
                query, items, u, negative_ids, item_ids, offsets, tile_seq, tile_row, lse, s0, q_norm, p_norm, grad,
                grad_q, grad_p, score_grad, query.stride(0), items.stride(0), grad_q.stride(0), grad_p.stride(0),
                dim, k, 1.0 / ctx.temperature, L2_EPS, L2=l2,
                BLOCK_M=BLOCK_M, BLOCK_K=block_k, BLOCK_D=BLOCK_D, INTERP=INTERPRET, num_warps=_warps(block_k),
            )  # fmt: skip
            _loss_bwd_negatives[(b, triton.cdiv(dim, 2 * BLOCK_D))](
                query, score_grad, offsets, grad_unit, query.stride(0), dim, k,
                BLOCK_M=BLOCK_M, BLOCK_K=block_k, BLOCK_D=2 * BLOCK_D, INTERP=INTERPRET, num_warps=_warps(block_k),
            )  # fmt: skip
        grad_n = grad_unit.reshape(b * k, dim)
        if l2 and norm is not None:
            grad_n = unit_rows_vjp_triton(grad_n, negatives, norm, out=claimed_n)
        elif l2:
            unit, norm32 = unit_rows(negatives.float())
            grad_n = unit_rows_vjp(grad_n, unit, norm32).to(negatives.dtype)
        else:
            grad_n = grad_n.to(negatives.dtype)
        if claimed_n is not None and grad_n is not claimed_n:  # written elsewhere: into its rows
            claimed_n.copy_(grad_n)
        return (grad_q, None if claimed_p is not None else grad_p, None if claimed_n is not None else grad_n,
                *(None,) * 10)  # fmt: skip


def _free(section: GradSection | None) -> torch.Tensor | None:
    """``section``'s rows of the lookup's gradient buffer when nothing is in them yet (this kernel writes
    them whole), else None (the gradient goes back to autograd, and the buffer's node adds it)."""
    if section is None:
        return None
    rows, accumulate = section.claim()
    return None if accumulate else rows


def shared_negatives_loss(
    query: torch.Tensor, items: torch.Tensor, negatives: torch.Tensor, lengths: torch.Tensor, item_ids: torch.Tensor,
    negative_ids: torch.Tensor, *, num_negatives: int, l2_normalize: bool, temperature: float,
    host_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss sum, count)`` of the shared-negative sampled softmax (the arguments of
    :class:`gem_model.api.NextItemLossKernel`); ``lengths`` are read back when ``host_lengths`` is None.
    A tile's scores are held in registers: past ``gem_kernels.next_item_loss.MAX_NEGATIVES`` negatives
    they spill (the registered kernel runs the torch loss there)."""
    dim = query.shape[1]
    if items.shape != query.shape:
        raise ValueError(f"next_item_loss: items must have the query's shape {tuple(query.shape)}, got "
                         f"{tuple(items.shape)}")  # fmt: skip
    if negatives.shape != (lengths.numel() * num_negatives, dim):
        raise ValueError(f"next_item_loss: shared negatives must be [B * K, D] = [{lengths.numel() * num_negatives}, "
                         f"{dim}], got {tuple(negatives.shape)}")  # fmt: skip
    host = (lengths if host_lengths is None else host_lengths).cpu()
    tile_seq, tile_row, count = _tiles(host, query.device)
    total = torch.full((), count, dtype=torch.long, device=query.device)
    if count == 0:
        return query.sum() * 0.0, total
    query = query if query.stride(1) == 1 else query.contiguous()
    items = items if items.stride(1) == 1 else items.contiguous()
    loss = _SharedNegativesLoss.apply(
        query, items, negatives.contiguous(), item_ids.contiguous(), negative_ids.contiguous(),
        offsets_of(lengths), tile_seq, tile_row, num_negatives, l2_normalize, temperature,
        *((grad_section(t) if torch.is_grad_enabled() and t.requires_grad else None) for t in (items, negatives)),
    )
    return loss, total
