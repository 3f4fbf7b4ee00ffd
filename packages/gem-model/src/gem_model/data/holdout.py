"""Held-out evaluation over the whole catalogue, from batches ready on the device.

A source that holds out one target per user (``movielens_1m``, and ``parquet`` with
``evaluation``) hands over :class:`EvalChunk` s: what the model reads, the targets and, with
``exclude_seen``, the items of the user's input history, which are not candidates (the HSTU
authors' ``filter_invalid_ids``). :func:`evaluate_chunks` ranks each target among every item
(:mod:`gem_model.data.ranking`): HR@K and NDCG@K, and beside them, with ``exclude_seen``, the same
metrics with every item a candidate as ``<metric>_unfiltered``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gem_model.data.batch import Batch
from gem_model.data.ranking import DEFAULT_KS, catalogue_ranks_each, ranking_metrics
from gem_model.jagged import positions_in_sequence, sequence_ids
from gem_model.train.progress import task_progress


@dataclass(frozen=True)
class EvalChunk:
    """One batch of users of a split, ready on the evaluation device."""

    batch: Batch
    targets: torch.Tensor  # int64 [B]
    seen: torch.Tensor | None  # int64 [B, M], -1 pads; None without exclude_seen


def padded_items(items: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``[B, M]`` rows of the jagged ``items`` (``lengths`` per row), ``-1`` pads."""
    out = torch.full((lengths.numel(), max(int(lengths.max()), 1) if lengths.numel() else 1), -1, dtype=torch.long)
    out[sequence_ids(lengths), positions_in_sequence(lengths)] = items.long()
    return out


@torch.no_grad()
def evaluate_chunks(
    model: nn.Module, chunks: list[EvalChunk], *, num_items: int, exclude_seen: bool, device: torch.device, split: str
) -> dict[str, float]:
    """The metrics of ``chunks`` (needs an unsharded item table: the trainer calls this on rank 0
    with the unwrapped model)."""
    items = model.item_embeddings().to(device)
    if items.shape[0] != num_items:
        raise ValueError(f"the model's item table has {items.shape[0]} rows, the catalogue {num_items}")
    # ranks[0]: every item a candidate; ranks[1] (with exclude_seen): without the user's input items
    ranks: list[list[torch.Tensor]] = [[] for _ in range(2 if exclude_seen else 1)]
    with task_progress(len(chunks), f"evaluate {split}", unit="batch") as advance:
        for chunk in chunks:
            queries = model.user_embeddings(chunk.batch).float()
            excludes = [None] if chunk.seen is None else [None, chunk.seen]
            for acc, r in zip(ranks, catalogue_ranks_each(queries, items, chunk.targets, excludes), strict=True):
                acc.append(r.cpu())
            advance(1)
    unfiltered = ranking_metrics(torch.cat(ranks[0]) if ranks[0] else torch.empty(0), DEFAULT_KS)
    if not exclude_seen:
        return unfiltered
    out = ranking_metrics(torch.cat(ranks[1]) if ranks[1] else torch.empty(0), DEFAULT_KS)
    out.update({f"{k}_unfiltered": v for k, v in unfiltered.items()})
    return out
