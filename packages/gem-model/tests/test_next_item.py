"""The next-item sampled softmax (``gem_model.model.next_item``) against direct implementations of its math."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from gem_model.config import ModelConfig
from gem_model.data.batch import FeatureSpec
from gem_model.jagged import offsets_of
from gem_model.model import next_item, next_item_plan
from gem_model.model.flops import count_flops

K, D, T = 5, 16, 0.05
LENGTHS = [0, 1, 3, 2, 9, 1, 0, 30, 4, 17, 2, 70]  # empty and length-1 sequences, several buckets


def inputs(lengths: list[int], per_position: bool, dtype: torch.dtype = torch.float32, seed: int = 0, items: int = 12,
           scale: float = 1.0, k: int = K, d: int = D):
    """Random ``(query, items, negatives, lengths, item_ids, negative_ids)``; few item ids, so that negatives hit positives."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(lengths)
    rows, preds = int(lens.sum()), int((lens - 1).clamp(min=0).sum())
    negs = (preds if per_position else lens.numel()) * k
    query = (scale * torch.randn(rows, d, generator=g)).to(dtype).requires_grad_()
    item_emb = (scale * torch.randn(rows, d, generator=g)).requires_grad_()
    neg_emb = (scale * torch.randn(negs, d, generator=g)).requires_grad_()
    return query, item_emb, neg_emb, lens, torch.randint(items, (rows,), generator=g), torch.randint(items, (negs,), generator=g)


def new_loss(args, per_position: bool, l2: bool, k: int = K):
    return next_item.next_item_loss(*args, num_negatives=k, per_position=per_position, l2_normalize=l2, temperature=T)


def reference_loss(args, per_position: bool, l2: bool, dtype: torch.dtype = torch.float64):
    """The math, directly: every predicted position gathers its own ``[K, D]`` negatives."""
    query, items, negatives, lengths, item_ids, negative_ids = args
    starts = offsets_of(lengths)[:-1]
    rows = torch.cat([s + torch.arange(max(int(n) - 1, 0)) for s, n in zip(starts.tolist(), lengths.tolist())])
    owner = torch.repeat_interleave(torch.arange(lengths.numel()), (lengths - 1).clamp(min=0))
    unit = (lambda z: F.normalize(z, dim=-1, eps=next_item.L2_EPS)) if l2 else (lambda z: z)
    q, p = unit(query[rows].to(dtype)), unit(items[rows + 1].to(dtype))
    if per_position:
        n, ids = negatives.to(dtype).reshape(-1, K, D), negative_ids.reshape(-1, K)
    else:
        n, ids = negatives.to(dtype).reshape(-1, K, D)[owner], negative_ids.reshape(-1, K)[owner]
    neg = (unit(n) * q[:, None, :]).sum(-1).masked_fill(ids == item_ids[rows + 1][:, None], float("-inf"))
    logits = torch.cat([(q * p).sum(-1, keepdim=True), neg], 1) / T
    return (torch.logsumexp(logits, 1) - logits[:, 0]).sum(), torch.tensor(rows.numel())


def padded_loss(args, per_position: bool):
    """The loss as ``GemModel.next_item_loss`` computed it before this module (no l2): shared negatives
    padded to the batch's longest sequence, one bmm."""
    query, items, negatives, lengths, item_ids, negative_ids = args
    ref_rows = reference_rows(lengths)
    rows, owner, pos = ref_rows
    q, p = query[rows].float(), items[rows + 1].float()
    b = lengths.numel()
    if per_position:
        neg = torch.bmm(negatives.reshape(-1, K, D), q[:, :, None]).squeeze(-1)
        ids = negative_ids.reshape(-1, K)
    else:
        padded = q.new_zeros(b, int(lengths.max()) - 1, D).index_put((owner, pos), q)
        neg = torch.bmm(padded, negatives.reshape(b, K, D).transpose(1, 2))[owner, pos]
        ids = negative_ids.reshape(b, K)[owner]
    neg = neg.masked_fill(ids == item_ids[rows + 1][:, None], float("-inf"))
    logits = torch.cat([(q * p).sum(-1, keepdim=True), neg], 1) / T
    return (torch.logsumexp(logits, 1) - logits[:, 0]).sum()


def reference_rows(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    starts = offsets_of(lengths)[:-1].tolist()
    n = (lengths - 1).clamp(min=0).tolist()
    rows = torch.cat([s + torch.arange(c) for s, c in zip(starts, n)])
    owner = torch.repeat_interleave(torch.arange(lengths.numel()), torch.tensor(n))
    return rows, owner, torch.cat([torch.arange(c) for c in n])


def grads(loss: torch.Tensor, args) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, args[:3]))


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """Max abs difference within ``rel`` of the largest magnitude of ``want``."""
    err = float((got.double() - want.double()).abs().max())
    assert err <= rel * float(want.double().abs().max()), (err, float(want.abs().max()))


@pytest.mark.parametrize("per_position", [False, True], ids=["shared", "per_position"])
@pytest.mark.parametrize("l2", [False, True], ids=["dot", "l2"])
def test_fp32_matches_the_math(per_position, l2, monkeypatch):
    monkeypatch.setattr(next_item_plan, "CHUNK_ELEMENTS", 40 * D)  # several chunks and row ranges
    for seed in range(3):
        args = inputs(LENGTHS, per_position, seed=seed)
        got, count = new_loss(args, per_position, l2)
        want, want_count = reference_loss(args, per_position, l2)
        assert int(count) == int(want_count) == sum(max(n - 1, 0) for n in LENGTHS)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0.0)
        for g, r in zip(grads(got, args), grads(want, args)):
            close(g, r, 1e-5)


@pytest.mark.parametrize("per_position", [False, True], ids=["shared", "per_position"])
def test_fp32_without_l2_keeps_the_bits_of_the_padded_loss(per_position, monkeypatch):
    """Row for row the same GEMMs and ops as before (one bucket, one chunk), so the same bits, gradients too."""
    monkeypatch.setattr(next_item_plan, "BUCKET_GROWTH", 100.0)
    args = inputs(LENGTHS, per_position, seed=4)
    got, want = new_loss(args, per_position, False)[0], padded_loss(args, per_position)
    assert torch.equal(got, want)
    assert all(torch.equal(g, r) for g, r in zip(grads(got, args), grads(want, args)))


@pytest.mark.parametrize("per_position", [False, True], ids=["shared", "per_position"])
@pytest.mark.parametrize("l2", [False, True], ids=["dot", "l2"])
def test_bf16_queries_match_the_math_within_bf16_rounding(per_position, l2):
    """bf16 queries (the activations), fp32 embeddings. Shared negatives: the GEMMs round the
    embeddings to bf16 (2^-9 relative) and accumulate in fp32, and the gradients flow in bf16; seen:
    3e-4 of the loss, 1e-2 of a gradient's largest entry. Per position: scored in the negatives'
    fp32 (~1e-7). Logits / T of a few units (as with l2; the plain dot products are scaled to that).
    Tolerance: 2e-3 of the loss, 3e-2 of a gradient's largest entry."""
    args = inputs(LENGTHS, per_position, dtype=torch.bfloat16, seed=5, scale=1.0 if l2 else 0.1)
    got, _ = new_loss(args, per_position, l2)
    want, _ = reference_loss(args, per_position, l2)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=2e-3, atol=0.0)
    for g, r, x in zip(grads(got, args), grads(want, args), args):
        assert g.dtype == x.dtype
        close(g, r, 3e-2)


def test_no_position_predicted():
    for lengths in ([0, 1, 1], [0]):
        args = inputs(lengths, False)
        loss, count = new_loss(args, False, True)
        assert float(loss.detach()) == 0.0 and int(count) == 0
        loss.backward()


@pytest.mark.parametrize("per_position", [False, True], ids=["shared", "per_position"])
@pytest.mark.parametrize("l2", [False, True], ids=["dot", "l2"])
def test_the_torch_kernel_is_the_function(per_position, l2):
    """``kernels.next_item_loss`` ``torch`` (gem-model's own, the default) returns what
    :func:`next_item_loss` returns, bit for bit, and so do the gradients; it runs anywhere."""
    kernel = next_item.TorchNextItemLoss()
    kernel.check_available(torch.device("cpu"))
    args = inputs(LENGTHS, per_position, dtype=torch.bfloat16, seed=2)
    options = {"num_negatives": K, "per_position": per_position, "l2_normalize": l2, "temperature": T}
    got = kernel(*args, **options, host_lengths=args[3])
    want = next_item.next_item_loss(*args, **options, host_lengths=args[3])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert all(torch.equal(g, r) for g, r in zip(grads(got[0], args), grads(want[0], args), strict=True))


class _Made(TorchDispatchMode):
    """The sizes of the tensors the ops make: outputs in new memory (not views, not in-place results)."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [*args, *(kwargs or {}).values()]
        old = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in old:
                self.sizes.append(t.numel())
        return out


@pytest.mark.parametrize("l2", [False, True], ids=["dot", "l2"])
def test_shared_negatives_never_build_positions_x_negatives_x_d_nor_the_padded_batch(l2, monkeypatch):
    """Nothing bigger than the inputs exists in forward or backward, and autograd keeps the inputs
    and O(P K) floats: neither [P, K, D] nor [B, max_len, D] (each far bigger here)."""
    k, d = 16, 64
    monkeypatch.setattr(next_item_plan, "CHUNK_ELEMENTS", 64 * d)
    lengths = [120, 60, 0, 40, 1, 30, 5, 3]
    args = inputs(lengths, False, k=k, d=d)
    rows, preds, b = sum(lengths), sum(max(n - 1, 0) for n in lengths), len(lengths)
    inputs_size = max(rows * d, b * k * d, preds * (k + 1))
    assert 8 * inputs_size < preds * k * d and 2 * inputs_size < b * (max(lengths) - 1) * d
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), _Made() as made:
        loss, _ = new_loss(args, False, l2, k=k)
        loss.backward()
    assert max(made.sizes) <= inputs_size
    ptrs = {x.data_ptr() for x in args[:3]}
    kept = [t for t in saved if t.data_ptr() not in ptrs and t.is_floating_point()]
    assert sum(t.numel() for t in kept) <= 6 * preds * (k + 1)


@pytest.mark.parametrize("l2", [False, True], ids=["dot", "l2"])
def test_per_position_negatives_are_neither_copied_nor_normalised_as_a_copy(l2):
    """The lookup's [P * K, D] is read in place; the backward makes one tensor of its size: its gradient."""
    args = inputs(LENGTHS, True)
    big = args[2].numel()
    with _Made() as forward:
        loss, _ = new_loss(args, True, l2)
    with _Made() as backward:
        torch.autograd.grad(loss, [args[2]])
    assert sum(n >= big for n in forward.sizes) == 0 and sum(n >= big for n in backward.sizes) == 1


@pytest.mark.parametrize("per_position", [False, True], ids=["shared", "per_position"])
@pytest.mark.parametrize("l2", [False, True], ids=["dot", "l2"])
def test_gemm_flops_are_the_analytic_count_three_times(per_position, l2):
    """Equal lengths (nothing padded): the GEMMs are 2 P K D forward and twice that backward, what
    ``flops.count_flops`` counts for the loss (``train_step`` = 3 x forward)."""
    lengths = [6, 6, 6, 6]
    args = inputs(lengths, per_position)
    with FlopCounterMode(display=False) as counter:
        loss, count = new_loss(args, per_position, l2)
        loss.backward()
    spec = FeatureSpec(num_items=12, num_actions=1, pooled=(), num_dense=0, tasks=(), num_negatives=K,
                       max_history=6, negatives_per_position=per_position)
    cfg = ModelConfig(embedding_dim=D, max_seq_len=8, use_side_features=False, use_candidate=False, cross_layers=0)
    analytic = count_flops(cfg, spec, torch.tensor(lengths)).loss
    assert analytic == 2 * int(count) * K * D
    assert counter.get_total_flops() == 3 * analytic


def test_buckets_bound_the_padding():
    counts = [0, 1, 3, 64, 65, 80, 81, 100, 101, 500, 4000, 3300, 7]
    chunks = next_item.group_by_length(counts, 8, growth=1.25, small=64, chunk_elements=8 * 300)
    seen = sorted(b for _, seqs in chunks for b in seqs)
    assert seen == [b for b, n in enumerate(counts) if n > 0]  # each sequence with a row, once
    for size, seqs in chunks:
        assert all(counts[b] <= size <= max(1.25 * counts[b], 64) for b in seqs)
        assert len(seqs) == 1 or size * len(seqs) <= 300  # a chunk holds one sequence or fits the budget
