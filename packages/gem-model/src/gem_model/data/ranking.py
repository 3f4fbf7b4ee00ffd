"""Full-catalogue ranking metrics: HR@K and NDCG@K of one held-out target per user.

Every item of the catalogue is a candidate, except, when ``exclude`` is given, the items listed there
for the user (the HSTU authors' trainer removes the items of the user's input history from the
ranking, as SASRec's evaluation does; the target itself always stays a candidate). The rank of the
target is the number of candidates that score at least as high as the target, the target itself
excluded: ties count against the target, so a model that scores everything alike gets no credit
(with learned float embeddings ties do not occur in practice). With 0-based ``rank``::

    HR@K   = 1                    if rank < K else 0
    NDCG@K = 1 / log2(rank + 2)   if rank < K else 0

(one relevant item per user, so the ideal DCG is 1). Metrics are means over users.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

DEFAULT_KS = (10, 50)


def target_ranks(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """0-based rank (int64 ``[B]``) of ``targets[b]`` among the ``[B, N]`` ``scores[b]``; ties count against it."""
    if scores.dim() != 2 or targets.shape != scores.shape[:1]:
        raise ValueError(f"scores must be [B, N] and targets [B]; got {tuple(scores.shape)} and {tuple(targets.shape)}")
    n = scores.shape[1]
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= n):
        raise ValueError(f"target ids must lie in [0, {n - 1}]; got {int(targets.min())}..{int(targets.max())}")
    target_score = scores.gather(1, targets[:, None].long())
    if bool(torch.isnan(scores).any()):
        raise ValueError("scores contain NaN: the model's query or item embeddings are not finite")
    # >= counts the target itself once: subtract it.
    return (scores >= target_score).sum(1) - 1


def exclude_items(scores: torch.Tensor, exclude: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``scores [B, N]`` with the ids of ``exclude [B, M]`` (``-1`` pads) set to ``-inf``, targets kept."""
    if exclude.dim() != 2 or exclude.shape[0] != scores.shape[0]:
        raise ValueError(f"exclude must be [B, M] with B = {scores.shape[0]}; got {tuple(exclude.shape)}")
    if exclude.numel() and int(exclude.max()) >= scores.shape[1]:
        raise ValueError(f"exclude holds id {int(exclude.max())}, outside the catalogue of {scores.shape[1]} items")
    mask = torch.zeros_like(scores, dtype=torch.bool)
    valid = exclude >= 0
    rows = torch.arange(scores.shape[0], device=scores.device)[:, None].expand_as(exclude)
    mask[rows[valid], exclude[valid]] = True
    mask[torch.arange(scores.shape[0], device=scores.device), targets.long()] = False
    return scores.masked_fill(mask, float("-inf"))


def catalogue_ranks(
    queries: torch.Tensor,
    items: torch.Tensor,
    targets: torch.Tensor,
    *,
    exclude: torch.Tensor | None = None,
    chunk: int = 1024,
) -> torch.Tensor:
    """Ranks of ``targets`` when ``queries [B, D]`` score every row of ``items [N, D]`` by inner product.

    ``exclude`` (``[B, M]`` item ids, ``-1`` pads) removes those items from each user's candidates.
    """
    return catalogue_ranks_each(queries, items, targets, [exclude], chunk=chunk)[0]


def catalogue_ranks_each(
    queries: torch.Tensor,
    items: torch.Tensor,
    targets: torch.Tensor,
    excludes: Sequence[torch.Tensor | None],
    *,
    chunk: int = 1024,
) -> list[torch.Tensor]:
    """:func:`catalogue_ranks` under each of ``excludes`` (None: every item a candidate), scoring each
    chunk of queries once for all of them."""
    out: list[list[torch.Tensor]] = [[] for _ in excludes]
    for s in range(0, queries.shape[0], chunk):
        scores = queries[s : s + chunk].float() @ items.float().T
        for ranks, exclude in zip(out, excludes, strict=True):
            chunk_scores = scores if exclude is None else exclude_items(scores, exclude[s : s + chunk], targets[s : s + chunk])
            ranks.append(target_ranks(chunk_scores, targets[s : s + chunk]))
    empty = torch.empty(0, dtype=torch.long, device=queries.device)
    return [torch.cat(ranks) if ranks else empty for ranks in out]


def hit_and_ndcg(ranks: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-user HR@k and NDCG@k (float64 ``[B]`` each) from 0-based ranks."""
    if k < 1:
        raise ValueError(f"k must be at least 1, got {k}")
    r = ranks.double()
    hit = (r < k).double()
    return hit, hit / torch.log2(r + 2.0)


def ranking_metrics(ranks: torch.Tensor, ks: Sequence[int] = DEFAULT_KS) -> dict[str, float]:
    """``{"hr@K": ..., "ndcg@K": ...}`` for every ``K`` in ``ks``: means over users (NaN when there are none)."""
    out: dict[str, float] = {}
    for k in ks:
        hit, ndcg = hit_and_ndcg(ranks.cpu(), k)
        out[f"hr@{k}"] = float(hit.mean()) if hit.numel() else math.nan
        out[f"ndcg@{k}"] = float(ndcg.mean()) if ndcg.numel() else math.nan
    return out
