"""HR@K and NDCG@K over the full catalogue, on hand-made cases with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from gem_model.data.ranking import catalogue_ranks, hit_and_ndcg, ranking_metrics, target_ranks


def test_rank_counts_the_items_scoring_higher():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.3], [0.8, 0.1, 0.2, 0.3], [0.0, 0.1, 0.2, 0.3]])
    assert target_ranks(scores, torch.tensor([2, 0, 0])).tolist() == [1, 0, 3]


def test_ties_count_against_the_target():
    """A model that scores every item alike gets no credit: its target ranks last."""
    scores = torch.ones(2, 5)
    assert target_ranks(scores, torch.tensor([0, 4])).tolist() == [4, 4]
    assert target_ranks(torch.tensor([[0.5, 0.7, 0.5, 0.1]]), torch.tensor([0])).tolist() == [2]


def test_hit_and_ndcg_of_single_ranks():
    hit, ndcg = hit_and_ndcg(torch.tensor([0, 1, 9, 10]), 10)
    assert hit.tolist() == [1.0, 1.0, 1.0, 0.0]
    expected = [1.0, 1 / math.log2(3), 1 / math.log2(11), 0.0]
    assert ndcg.tolist() == pytest.approx(expected)


def test_metrics_are_means_over_users():
    # ranks 0, 3, 12, 60 of four users
    m = ranking_metrics(torch.tensor([0, 3, 12, 60]), ks=(10, 50))
    assert m["hr@10"] == pytest.approx(2 / 4)
    assert m["ndcg@10"] == pytest.approx((1.0 + 1 / math.log2(5)) / 4)
    assert m["hr@50"] == pytest.approx(3 / 4)
    assert m["ndcg@50"] == pytest.approx((1.0 + 1 / math.log2(5) + 1 / math.log2(14)) / 4)
    assert set(m) == {"hr@10", "ndcg@10", "hr@50", "ndcg@50"}


def test_catalogue_ranks_by_inner_product_in_chunks():
    """Item i scores N - i for every user, so the target's rank is its id."""
    n = 64
    items = torch.eye(n)
    queries = (n - torch.arange(n, dtype=torch.float32)).repeat(7, 1)
    targets = torch.tensor([0, 5, 9, 10, 49, 50, 63])
    for chunk in (1, 3, 1024):
        assert catalogue_ranks(queries, items, targets, chunk=chunk).tolist() == targets.tolist()
    m = ranking_metrics(targets)
    assert m["hr@10"] == pytest.approx(3 / 7) and m["hr@50"] == pytest.approx(5 / 7)


def test_excluded_items_are_not_candidates_but_the_target_always_is():
    n = 10
    items = torch.eye(n)
    queries = (n - torch.arange(n, dtype=torch.float32)).repeat(3, 1)  # item i ranks i-th
    targets = torch.tensor([5, 5, 2])
    exclude = torch.tensor([[0, 1, 7, -1], [-1, -1, -1, -1], [2, 0, 1, 3]])  # user 3 lists its own target
    assert catalogue_ranks(queries, items, targets, exclude=exclude).tolist() == [3, 5, 0]
    assert catalogue_ranks(queries, items, targets, exclude=exclude, chunk=1).tolist() == [3, 5, 0]
    with pytest.raises(ValueError, match="outside the catalogue of 10 items"):
        catalogue_ranks(queries, items, targets, exclude=torch.tensor([[10], [0], [0]]))
    with pytest.raises(ValueError, match=r"exclude must be \[B, M\] with B = 3"):
        catalogue_ranks(queries, items, targets, exclude=torch.tensor([0, 1, 2]))


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match=r"target ids must lie in \[0, 3\]"):
        target_ranks(torch.zeros(1, 4), torch.tensor([4]))
    with pytest.raises(ValueError, match="NaN"):
        target_ranks(torch.tensor([[0.1, float("nan")]]), torch.tensor([0]))
    with pytest.raises(ValueError, match=r"\[B, N\]"):
        target_ranks(torch.zeros(4), torch.tensor([0]))
    with pytest.raises(ValueError, match="k must be at least 1"):
        hit_and_ndcg(torch.tensor([0]), 0)
