"""The ``next_item_loss`` kernels (core ``torch``, gem-kernels ``triton``) against a float64 reference.

The reference computes the loss of :mod:`gem_model.model.next_item` densely in float64 from the
operands as the kernels see them (the positive cast to the query's dtype, the negatives normalised
in float32 and cast), with gradients through the casts as identity and through the normalisation
exactly. Fresh random data per test (the ``gen`` fixture prints its seed); fresh memory is NaN
(``poison``), so an output element that no kernel writes fails the comparison.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gem_kernels.next_item_loss import MAX_NEGATIVES, TritonNextItemLoss
from gem_kernels.testing import relative_error
from gem_model.api import L2_EPS, NextItemLossKernel, unit_rows
from gem_model.model.next_item import TorchNextItemLoss

pytestmark = pytest.mark.usefixtures("poison")

TOLERANCE = {"loss": 1e-5, "query": 1e-2, "items": 1e-3, "negatives": 1e-2}
"""Relative (Frobenius) errors against float64. The query and negatives gradients pass through
bf16 score gradients (as the torch loss's GEMMs do); the items' gradient is float32 from per-row scalars."""


def _rounded(exact: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` forward, the identity gradient to ``exact`` (a cast, as autograd sees one)."""
    return exact + (value.double() - exact).detach()


def reference(query: torch.Tensor, items: torch.Tensor, negatives: torch.Tensor, lengths: list[int],
              item_ids: torch.Tensor, negative_ids: torch.Tensor, k: int, l2: bool, temperature: float):  # fmt: skip
    """``(loss sum, [grad query, grad items, grad negatives])`` in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (query, items, negatives)]
    q_all, items64, neg64 = leaves
    p_all = _rounded(items64, items.to(query.dtype))
    if l2:
        units = _rounded(F.normalize(neg64, dim=-1, eps=L2_EPS), unit_rows(negatives.float())[0].to(query.dtype))
    else:
        units = _rounded(neg64, negatives.to(query.dtype))
    total = torch.zeros((), dtype=torch.float64)
    start = 0
    for b, n in enumerate(lengths):
        for i in range(start, start + n - 1):
            q, p, u = q_all[i], p_all[i + 1], units[b * k : (b + 1) * k]
            if l2:
                q_unit = q / q.norm().clamp_min(L2_EPS)
                s0 = q_unit @ (p / p.norm().clamp_min(L2_EPS))
                s = u @ q_unit
            else:
                s0, s = q @ p, u @ q
            s = s.masked_fill(negative_ids[b * k : (b + 1) * k] == item_ids[i + 1], float("-inf"))
            logits = torch.cat([s0[None], s]) / temperature
            total = total + torch.logsumexp(logits, 0) - logits[0]
        start += n
    return total.detach(), list(torch.autograd.grad(total, leaves))


def batch(gen: torch.Generator, lengths: list[int], dim: int, k: int, dtype: torch.dtype, hits: bool):
    rows = sum(lengths)
    query = torch.randn(rows, dim, generator=gen).to(dtype)
    items = torch.randn(rows, dim, generator=gen)
    negatives = torch.randn(len(lengths) * k, dim, generator=gen)
    item_ids = torch.randint(0, 40, (rows,), generator=gen)
    negative_ids = torch.randint(40 if not hits else 0, 80, (len(lengths) * k,), generator=gen)
    return query, items, negatives, torch.tensor(lengths), item_ids, negative_ids


def run(kernel: NextItemLossKernel, args: tuple, k: int, l2: bool, temperature: float, host: bool):
    query, items, negatives, lengths, item_ids, negative_ids = args
    leaves = [t.detach().requires_grad_() for t in (query, items, negatives)]
    loss, count = kernel(*leaves, lengths, item_ids, negative_ids, num_negatives=k, per_position=False,
                         l2_normalize=l2, temperature=temperature, host_lengths=lengths if host else None)  # fmt: skip
    return loss, count, list(torch.autograd.grad(loss, leaves))


@pytest.mark.parametrize("kernel", [TorchNextItemLoss(), TritonNextItemLoss()], ids=["torch", "triton"])
@pytest.mark.parametrize("l2", [True, False], ids=["l2", "dot"])
def test_matches_float64_reference(gen: torch.Generator, kernel: NextItemLossKernel, l2: bool) -> None:
    # empty and single-row sequences (nothing to predict), one over two 32-row tiles, D and K not powers of two
    lengths, dim, k = [5, 0, 1, 67, 3], 40, 6
    args = batch(gen, lengths, dim, k, torch.bfloat16, hits=True)
    temperature = 0.2 if l2 else 1.0
    loss, count, grads = run(kernel, args, k, l2, temperature, host=True)
    expected, expected_grads = reference(*args[:3], lengths, *args[4:], k, l2, temperature)
    assert int(count) == sum(max(n - 1, 0) for n in lengths)
    found = {"loss": relative_error(loss, expected)}
    found |= {n: relative_error(g, e) for n, g, e in zip(("query", "items", "negatives"), grads, expected_grads)}
    assert all(found[n] <= TOLERANCE[n] for n in TOLERANCE), found
    # what predicts nothing gets exactly nothing: each sequence's last query row, first item row
    last_rows, first_rows = [4, 5, 72, 75], [0, 5, 6, 73]
    assert grads[0][last_rows].abs().max() == 0 and grads[1][first_rows].abs().max() == 0
    assert grads[2][k : 2 * k].abs().max() == 0  # the empty sequence's negatives


def test_triton_with_the_unit_rows_kernel_matches_float64_reference(gen: torch.Generator, monkeypatch) -> None:
    """``UNIT_ROWS_KERNEL``: the negatives normalised by ``gem_kernels.unit_rows_triton`` (bf16 negatives,
    as the big config's bf16 lookups give them), the same tolerances as torch's normalisation."""
    from gem_kernels import next_item_loss_triton

    monkeypatch.setattr(next_item_loss_triton, "UNIT_ROWS_KERNEL", True)
    lengths, dim, k = [5, 0, 1, 67, 3], 40, 6
    query, items, negatives, *rest = batch(gen, lengths, dim, k, torch.bfloat16, hits=True)
    args = (query, items, negatives.to(torch.bfloat16), *rest)
    loss, count, grads = run(TritonNextItemLoss(), args, k, True, 0.2, host=True)
    expected, expected_grads = reference(*args[:3], lengths, *args[4:], k, True, 0.2)
    assert int(count) == sum(max(n - 1, 0) for n in lengths)
    found = {"loss": relative_error(loss, expected)}
    found |= {n: relative_error(g, e) for n, g, e in zip(("query", "items", "negatives"), grads, expected_grads)}
    assert all(found[n] <= TOLERANCE[n] for n in TOLERANCE), found
    assert grads[2].dtype == torch.bfloat16 and grads[2][k : 2 * k].abs().max() == 0


def test_triton_gives_the_same_bits_twice(gen: torch.Generator) -> None:
    """No atomics and no race: the same inputs give the same loss and gradients, bit for bit."""
    lengths, dim, k = [70, 3, 0, 9], 40, 6
    args = batch(gen, lengths, dim, k, torch.bfloat16, hits=True)
    first, second = (run(TritonNextItemLoss(), args, k, True, 0.1, host=True) for _ in range(2))
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(a, b) for a, b in zip(first[2], second[2], strict=True))


def test_triton_equals_torch_loss_without_host_lengths(gen: torch.Generator) -> None:
    """Lengths read back from the device give the same loss; float16 queries run the kernels too."""
    lengths, dim, k = [9, 2, 14], 24, 5
    args = batch(gen, lengths, dim, k, torch.float16, hits=False)
    got = run(TritonNextItemLoss(), args, k, True, 0.1, host=False)
    want = run(TorchNextItemLoss(), args, k, True, 0.1, host=True)
    assert relative_error(got[0], want[0]) <= TOLERANCE["loss"]
    for g, w, name in zip(got[2], want[2], ("query", "items", "negatives")):
        assert relative_error(g, w) <= 2 * TOLERANCE[name], name


@pytest.mark.parametrize("case", ["fp32", "per_position", "many_negatives"])
def test_runs_the_torch_loss_where_the_kernels_do_not_apply(gen: torch.Generator, case: str) -> None:
    """fp32 queries, per-position negatives and more than MAX_NEGATIVES negatives: the core's loss, bit for bit."""
    lengths, dim = [4, 3], 16
    k = MAX_NEGATIVES + 1 if case == "many_negatives" else 3
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    args = list(batch(gen, lengths, dim, k, dtype, hits=False))
    per_position = case == "per_position"
    if per_position:  # one negative list per predicted position
        args[2] = torch.randn(sum(n - 1 for n in lengths) * k, dim, generator=gen)
        args[5] = torch.randint(40, 80, (sum(n - 1 for n in lengths) * k,), generator=gen)
    kw = dict(num_negatives=k, per_position=per_position, l2_normalize=True, temperature=0.5)
    got = TritonNextItemLoss()(*args, **kw)
    want = TorchNextItemLoss()(*args, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_negatives_shape_names_the_argument(gen: torch.Generator) -> None:
    from gem_kernels.next_item_loss_triton import shared_negatives_loss

    query, items, negatives, lengths, item_ids, negative_ids = batch(gen, [3, 2], 16, 4, torch.bfloat16, hits=False)
    with pytest.raises(ValueError, match=r"shared negatives must be \[B \* K, D\] = \[8, 16\]"):
        shared_negatives_loss(query, items, negatives[:5], lengths, item_ids, negative_ids, num_negatives=4,
                              l2_normalize=False, temperature=1.0)  # fmt: skip
