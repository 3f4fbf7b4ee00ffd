"""The next-item sampled softmax: position i of a history predicts the item at i + 1.

Math. For a predicted position with query ``q`` (the sequence tower's output), positive ``p`` (the
next item's embedding) and negatives ``n_1..n_K``, with ``u(x) = x / max(|x|, 1e-6)`` when
``l2_normalize`` (else ``u(x) = x``) and temperature ``T``::

    s_0 = u(q) . u(p),   s_k = u(q) . u(n_k)  (s_k = -inf where n_k is the positive item)
    loss = logsumexp(s_0 / T, ..., s_K / T) - s_0 / T

The result is the sum of the loss over the predicted positions (every history position but the
last of its sequence: P of them) and their count; the trainer normalises by the global count.

The model calls it through the ``kernels.next_item_loss`` kernel
(:class:`~gem_model.kernels.NextItemLossKernel`): the default, ``torch``, is
:class:`TorchNextItemLoss`, this module's :func:`next_item_loss`; gem-kernels registers ``triton``.

Shared negatives (K per sample, shared by its positions) are scored by :class:`_SharedScores`: one
batched GEMM per chunk of sequences of similar length. Sequences are bucketed by their number of
predicted positions (a bucket holds counts within ``BUCKET_GROWTH`` of its longest; counts up to
``SMALL_BUCKET`` share one) and a bucket is split into chunks of at most ``CHUNK_ELEMENTS / D``
padded rows (planned in :mod:`gem_model.model.next_item_plan`). A chunk gathers its queries, in
their own dtype (bf16 when the activations are), into ``[c, s, D]`` and multiplies them with its
sequences' ``[c, K, D]`` negatives (cast from the fp32 tables) into fp32 logits. With
``l2_normalize`` nothing ``[rows, D]``-sized is normalised as a copy: ``s_k = (q . u(n_k)) / |q|``
from per-row norms, and the backward's normalisation terms are per-row scalars from the saved
logits. Why this and not:

* padding the batch to its longest sequence (before): ~8x the work at power-law lengths (mean
  500, max 4096) and a ``[B, max_len, D]`` fp32 copy (8 GiB at B = 512, D = 1024);
* gathering each position's negatives (``[P, K, D]``): K times the queries' size;
* a grouped GEMM over the jagged rows (``torch._grouped_mm``): pads nothing, but needs torch >= 2.8
  and Hopper for its fast path, and torch 2.11's writes bf16 logits only. Its three GEMMs take
  0.9 ms at the big config on an H200; the whole loss here takes 17 ms there (the old one 73 ms,
  ``benchmarks/results/next_item_loss.md``), mostly elementwise passes, so the padding (1.15 slots
  per row there) is not what costs. Bucketing runs on any torch and device.

Memory (shared). Autograd keeps references to the inputs (no copies), the fp32 ``[P, K]`` logits,
a few ``[P]`` vectors and the O(P) int64 plan; the loss's ``logsumexp`` keeps ``[P, K + 1]``:
O(P K) floats. Nothing ``[P, K, D]`` or ``[B, max_len, D]`` exists at any time: the largest
transients are a chunk's ``[<= CHUNK_ELEMENTS / D, D]`` buffers, the padded fp32 logits
``[~1.15 P, K]`` and the negatives' ``[B, K, D]``; the inputs' gradients are the only tensors of
their size. At P = 256k, K = 128, D = 1024, B = 512 with bf16 queries: ~0.25 GiB kept for the
backward, ~1.3 GiB at the peak besides the 1.7 GiB of input gradients (before: ~12.7 GiB kept,
~20 GiB at the peak).

Per-position negatives (``[P * K, D]`` from the lookup itself, the HSTU paper's way) are scored by
:class:`_PerPositionScores`: a batched matrix-vector product over the lookup's output as it is
(the view ``[P, K, D]``; no cast; with ``l2_normalize`` the dot products are divided by the
negatives' norms instead of normalising a copy), in the negatives' dtype, since it is bound by
reading them; the backward makes one tensor of their size, their gradient.

Precision: the GEMMs run in the query's dtype with fp32 outputs (``torch.bmm(..., out_dtype=)``
on CUDA, an fp32 GEMM of the same values elsewhere); the positive is cast to the query's dtype
like the negatives, so that both are scored alike; norms, logits and the softmax are fp32. With
fp32 inputs and no ``l2_normalize`` the result and the gradients are those of the padded GEMM
before, bit for bit; with ``l2_normalize`` dividing by the norms rather than normalising first
changes the last bits (~1e-7 relative; ``tests/test_next_item.py``).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from gem_model.components import NextItemLossKernel
from gem_model.jagged import matmul_fp32, offsets_of, positions_in_sequence, sequence_ids
from gem_model.model.next_item_plan import (
    BUCKET_GROWTH,
    CHUNK_ELEMENTS,
    SMALL_BUCKET,
    Chunk,
    Plan,
    group_by_length,
    plan_chunks,
    row_ranges,
)

__all__ = [  # the chunk planning lives in next_item_plan (set its constants there); importable from here too
    "BUCKET_GROWTH", "CHUNK_ELEMENTS", "L2_EPS", "SMALL_BUCKET", "Chunk", "Plan", "TorchNextItemLoss",
    "group_by_length", "next_item_loss", "plan_chunks", "unit_rows", "unit_rows_vjp",
]  # fmt: skip

L2_EPS = 1e-6
"""The ``eps`` of the L2 normalisation (``F.normalize``): ``u(x) = x / max(|x|, L2_EPS)``."""


def next_item_loss(
    query: Tensor, items: Tensor, negatives: Tensor, lengths: Tensor, item_ids: Tensor, negative_ids: Tensor, *,
    num_negatives: int, per_position: bool, l2_normalize: bool, temperature: float,
    host_lengths: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(loss sum, count)`` over the predicted positions of jagged histories.

    ``query`` ``[L, D]``: the tower's output at each history row (any float dtype); ``items``
    ``[L, D]``: the embeddings of the history's items; ``lengths`` ``[B]``; ``item_ids`` ``[L]``;
    ``negatives`` / ``negative_ids``: ``[B * K, D]`` / ``[B * K]`` (shared) or, with
    ``per_position``, ``[P * K, D]`` / ``[P * K]`` in the order of the predicted positions.
    ``host_lengths``: ``lengths`` on the host, if the caller has them (the plan then needs no sync).
    """
    k, d = num_negatives, query.shape[1]
    if per_position:
        offsets = offsets_of(lengths)
        pos = positions_in_sequence(lengths, offsets)
        rows = torch.nonzero(pos < (lengths[sequence_ids(lengths, pos.numel())] - 1)).squeeze(1)
        count = torch.tensor(rows.numel(), device=lengths.device)
        if rows.numel() == 0:
            return query.sum() * 0.0, count
        q, p = query[rows].float(), items[rows + 1].float()
        if l2_normalize:
            q, p = unit_rows(q)[0], unit_rows(p)[0]
        pos_logit = (q * p).sum(-1)
        neg_logit = _PerPositionScores.apply(q, negatives.reshape(rows.numel(), k, d), l2_normalize)
        hit = negative_ids.reshape(rows.numel(), k) == item_ids[rows + 1][:, None]
        neg_logit = neg_logit.masked_fill(hit, float("-inf"))
    else:
        plan = plan_chunks(lengths, d, host_lengths=host_lengths)
        count = torch.full((), plan.rows, dtype=torch.long, device=lengths.device)  # a fill: no host copy
        if plan.rows == 0:
            return query.sum() * 0.0, count
        neg = negatives.reshape(lengths.numel(), k, d)
        pos_logit, neg_logit = _SharedScores.apply(
            query, items, neg, negative_ids.reshape(lengths.numel(), k), item_ids, plan, l2_normalize
        )
    logits = torch.cat([pos_logit[:, None], neg_logit], 1) / temperature
    loss = torch.logsumexp(logits, 1) - logits[:, 0]
    return loss.sum(), count


class TorchNextItemLoss(NextItemLossKernel):
    """The ``next_item_loss`` kernel ``torch``: :func:`next_item_loss` itself, on any device and dtype.

    gem-model registers it (:mod:`gem_model.builtin`) and it is the default of ``kernels.next_item_loss``,
    so a run needs no plugin for its loss.
    """

    name: ClassVar[str] = "torch"

    def __call__(
        self,
        query: Tensor,
        items: Tensor,
        negatives: Tensor,
        lengths: Tensor,
        item_ids: Tensor,
        negative_ids: Tensor,
        *,
        num_negatives: int,
        per_position: bool,
        l2_normalize: bool,
        temperature: float,
        host_lengths: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        return next_item_loss(
            query, items, negatives, lengths, item_ids, negative_ids, num_negatives=num_negatives,
            per_position=per_position, l2_normalize=l2_normalize, temperature=temperature,
            host_lengths=host_lengths,
        )  # fmt: skip


# ------------------------------------------------------------------------------------- the scores


def unit_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(F.normalize(x, dim=-1, eps=L2_EPS), |x|)``, the norms ``[..., 1]``: the same ops as
    ``F.normalize``, so the same bits. A kernel of ``next_item_loss`` that normalises as this loss does
    uses it (and :func:`unit_rows_vjp` for the gradient)."""
    norm = x.norm(2, -1, keepdim=True)
    return x / norm.clamp_min(L2_EPS), norm


def unit_rows_vjp(grad: Tensor, unit: Tensor, norm: Tensor) -> Tensor:
    """The gradient through ``u(x) = x / max(|x|, L2_EPS)`` of ``grad`` (the gradient of ``u(x)``), with
    ``unit, norm = unit_rows(x)``: ``(g - u (u . g)) / |x|`` (``g / L2_EPS`` where clamped). Writes into
    a new tensor; ``grad`` is left as it was."""
    along = (unit * grad).sum(-1, keepdim=True).mul_(norm >= L2_EPS)
    return (grad - unit * along).div_(norm.clamp_min(L2_EPS))


def _row_dot(q: Tensor, p: Tensor) -> Tensor:
    """``(q * p).sum(-1)`` in fp32; in lower precision as a batched GEMM (fp32 accumulation, no product tensor)."""
    if q.dtype == torch.float32:
        return (q * p).sum(-1)
    return matmul_fp32(q[:, None, :], p[:, :, None]).view(-1)


def _per_row(values: Tensor, rows: Tensor, total: int) -> Tensor:
    """``[total, 1]``: ``values`` at ``rows``, zero elsewhere."""
    return torch.zeros(total, 1, dtype=values.dtype, device=values.device).index_copy_(0, rows, values[:, None])


class _SharedScores(torch.autograd.Function):
    """``(s_0 [P], s_1..K [P, K])`` of shared negatives (see the module's docstring).

    With L2 normalisation the rows are never normalised as copies: ``s_k = (q . u(n_k)) / |q|`` and
    ``s_0 = (q . p) / (|q| |p|)``, from per-row norms, so that the queries enter the GEMM as they
    are, and the backward's normalisation terms are per-row scalars (``|q|^-2 (sum_k g_k s_k + g_0 s_0)``
    times ``q``) computed from the saved logits instead of more ``[rows, D]`` passes. Per-row work
    (norms, the positive's dot product, those terms) runs on contiguous row ranges, where the
    query of row ``i`` pairs with the item of row ``i + 1`` as views, without a gather. The
    positives are cast to the query's dtype like the negatives, so that both are scored alike.
    """

    @staticmethod
    def forward(ctx, query: Tensor, items: Tensor, negatives: Tensor, negative_ids: Tensor, item_ids: Tensor,  # type: ignore[override]
                plan: Plan, l2: bool) -> tuple[Tensor, Tensor]:
        dt, (k, d), pairs = query.dtype, negatives.shape[1:], query.shape[0] - 1
        dot = torch.empty(pairs, device=query.device)  # q_i . p_(i+1), for every row but the last
        q_norm, p_norm = (torch.empty_like(dot), torch.empty_like(dot)) if l2 else (None, None)
        for a, b in row_ranges(pairs, d):
            q, p = query[a:b], items[a + 1 : b + 1].to(dt)
            dot[a:b] = _row_dot(q, p)
            if q_norm is not None and p_norm is not None:
                torch.linalg.vector_norm(q, dim=-1, dtype=torch.float32, out=q_norm[a:b])
                torch.linalg.vector_norm(p, dim=-1, dtype=torch.float32, out=p_norm[a:b])
        neg = (unit_rows(negatives.float())[0] if l2 else negatives).to(dt).index_select(0, plan.seqs)
        padded = torch.empty(plan.slot_rows.numel(), k, device=query.device)  # fp32 logits of every slot
        for ch in plan.chunks:
            q = query.index_select(0, plan.slot_rows[ch.slots]).view(ch.count, ch.size, d)
            padded[ch.slots] = matmul_fp32(q, neg[ch.seqs].transpose(1, 2)).view(-1, k)
        neg_logit = padded.index_select(0, plan.pred_slots)
        del padded
        pos_logit = dot.index_select(0, plan.pred_rows)
        if q_norm is not None and p_norm is not None:  # the norms of each predicted position's q and p
            q_norm, p_norm = q_norm.index_select(0, plan.pred_rows), p_norm.index_select(0, plan.pred_rows)
            q_scale = 1.0 / q_norm.clamp_min(L2_EPS)
            neg_logit.mul_(q_scale[:, None])
            pos_logit = pos_logit * q_scale / p_norm.clamp_min(L2_EPS)
        hit = negative_ids.index_select(0, plan.pred_seqs) == item_ids.index_select(0, plan.pred_rows + 1)[:, None]
        neg_logit.masked_fill_(hit, float("-inf"))  # a negative that is the positive item does not count
        ctx.save_for_backward(query, items, negatives, pos_logit, neg_logit, q_norm, p_norm)
        ctx.plan = plan
        return pos_logit, neg_logit

    @staticmethod
    def backward(ctx, grad_pos: Tensor, grad_neg: Tensor):  # type: ignore[override]
        query, items, negatives, pos_logit, neg_logit, q_norm, p_norm = ctx.saved_tensors
        plan: Plan = ctx.plan
        need_q, need_p, need_n = ctx.needs_input_grad[:3]
        dt, (b, k, d), pairs = query.dtype, negatives.shape, query.shape[0] - 1
        l2 = q_norm is not None
        negatives32 = negatives.float()
        unit, norm = unit_rows(negatives32) if l2 else (negatives32, None)
        neg = unit.to(dt).index_select(0, plan.seqs)
        # per predicted position: grad_q += a p - c q (besides the GEMM's part), grad_p = a q - e p;
        # with l2, c and e are the norms' terms, |x|^-2 (sum of g s) where the norm was not clamped
        a, c, e, g = grad_pos, None, None, grad_neg
        if q_norm is not None and p_norm is not None:
            q_scale, p_scale = 1.0 / q_norm.clamp_min(L2_EPS), 1.0 / p_norm.clamp_min(L2_EPS)
            along = (grad_neg * neg_logit).nan_to_num_(0.0).sum(-1) + grad_pos * pos_logit  # -inf logits: g = 0
            a = grad_pos * q_scale * p_scale
            c = along * q_scale * q_scale * (q_norm >= L2_EPS)
            e = grad_pos * pos_logit * p_scale * p_scale * (p_norm >= L2_EPS)
            g = grad_neg * q_scale[:, None]  # the gradient of q . u(n_k)
        # the gradient of every slot, zero for the padding (slot_preds = P there)
        g = torch.cat([g, g.new_zeros(1, k)]).to(dt).index_select(0, plan.slot_preds)
        grad_q = torch.zeros_like(query) if need_q else None
        # without l2 the negatives' gradient is q^T g as autograd computes a bmm's second operand's, in
        # its [B, D, K] layout, so that fp32 gradients keep the bits they had before this module
        grad_unit = negatives.new_zeros((b, k, d) if l2 else (b, d, k), dtype=torch.float32) if need_n else None
        for ch in plan.chunks:
            gc = g[ch.slots].view(ch.count, ch.size, k)
            if grad_q is not None:
                gq = torch.bmm(gc, neg[ch.seqs]).view(-1, d).index_select(0, plan.valid_slots[ch.valid])
                grad_q.index_copy_(0, plan.valid_rows[ch.valid], gq)
            if grad_unit is not None:
                q = query.index_select(0, plan.slot_rows[ch.slots]).view(ch.count, ch.size, d)
                gn = matmul_fp32(gc.transpose(1, 2), q) if l2 else matmul_fp32(q.transpose(1, 2), gc)
                grad_unit.index_copy_(0, plan.seqs[ch.seqs], gn)
        grad_p = torch.zeros_like(items) if need_p else None
        # [rows - 1, 1] per query row, zero where a row predicts nothing
        a_row, c_row, e_row = (None if v is None else _per_row(v, plan.pred_rows, pairs) for v in (a, c, e))
        assert a_row is not None
        for r0, r1 in row_ranges(pairs, d):
            q, p, ra = query[r0:r1], items[r0 + 1 : r1 + 1], a_row[r0:r1]
            if grad_q is not None:
                gq = grad_q[r0:r1]
                if dt == torch.float32:  # as autograd adds the positive's term (the same bits)
                    gq.add_(p * ra)
                else:  # one fused pass in the query's dtype
                    gq.addcmul_(p.to(dt), ra.to(dt))
                if c_row is not None:
                    gq.addcmul_(q, c_row[r0:r1].to(dt), value=-1)
            if grad_p is not None:
                gp = grad_p[r0 + 1 : r1 + 1]
                torch.mul(q, ra, out=gp)
                if e_row is not None:
                    gp.addcmul_(p, e_row[r0:r1], value=-1)
        grad_n = None
        if grad_unit is not None:
            grad_n = (unit_rows_vjp(grad_unit, unit, norm) if norm is not None else grad_unit.transpose(1, 2))
            grad_n = grad_n.to(negatives.dtype)
        return grad_q, grad_p, grad_n, None, None, None, None


class _PerPositionScores(torch.autograd.Function):
    """``s [P, K]``: each position's query ``[P, D]`` (normalised already, with l2) against its own negatives."""

    @staticmethod
    def forward(ctx, query: Tensor, negatives: Tensor, l2: bool) -> Tensor:  # type: ignore[override]
        scores = matmul_fp32(negatives, query.to(negatives.dtype)[:, :, None]).squeeze(-1)
        norm = None
        if l2:  # u(n) . q = (n . q) / max(|n|, eps): no normalised [P, K, D] copy of the negatives
            norm = torch.linalg.vector_norm(negatives, dim=-1, dtype=torch.float32)
            scores = scores / norm.clamp_min(L2_EPS)
        ctx.save_for_backward(query, negatives, scores, norm)
        ctx.l2 = l2
        return scores

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        query, negatives, scores, norm = ctx.saved_tensors
        g = grad / norm.clamp_min(L2_EPS) if ctx.l2 else grad
        grad_q = grad_n = None
        if ctx.needs_input_grad[0]:
            grad_q = torch.bmm(negatives.transpose(1, 2), g.to(negatives.dtype)[:, :, None]).squeeze(-1).to(query.dtype)
        if ctx.needs_input_grad[1]:
            q = query.to(negatives.dtype)[:, None, :]
            outer = g.to(negatives.dtype)[:, :, None]
            grad_n = torch.bmm(outer, q)
            if ctx.l2:  # the norm's part, in place: the gradient is the one [P, K, D] tensor made
                along = (g * scores * (norm >= L2_EPS) / norm.clamp_min(L2_EPS)).to(negatives.dtype)
                grad_n.addcmul_(negatives, along[:, :, None], value=-1)
        return grad_q, grad_n, None
