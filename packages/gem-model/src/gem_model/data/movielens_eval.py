"""The MovieLens-1M evaluation: each user's held-out target ranked over the whole catalogue.

The source (:class:`gem_model.data.movielens.MovieLensSource`) knows each user's histories; this
module turns them into what the model reads for a split, the split's targets and, with
``exclude_seen``, the items of the user's input history, which are not candidates (the HSTU authors'
``filter_invalid_ids``). The ranking itself is :mod:`gem_model.data.holdout`.

Those inputs depend on the split and the source's options only, never on the model, so they are
built once per split and device and reused by every later evaluation of the run (the trainer
evaluates ``valid`` every ``trainer.eval_every`` steps).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gem_model.data.batch import Batch
from gem_model.data.holdout import EvalChunk, evaluate_chunks, padded_items
from gem_model.jagged import gather_rows

SPLITS = ("valid", "test")
# (users, split) -> (starts, lengths) of what the model reads in the flat sequences
HistoryFn = Callable[[torch.Tensor, str], tuple[torch.Tensor, torch.Tensor]]
# (users, split, negatives, sample_ids) -> the batch of those users' histories
BatchFn = Callable[[torch.Tensor, str, torch.Tensor, torch.Tensor], Batch]

__all__ = ["SPLITS", "EvalChunk", "MovieLensEvaluation"]


class MovieLensEvaluation:
    """HR@10/50 and NDCG@10/50 of the first ``users`` users' held-out targets, in batches of ``batch_size``.

    ``items`` are the flat item ids of every user's ratings in time order, ``history`` and
    ``build_batch`` the source's (the item at ``starts + lengths`` is the split's target).
    """

    def __init__(
        self,
        *,
        items: torch.Tensor,
        num_items: int,
        users: int,
        history: HistoryFn,
        build_batch: BatchFn,
        batch_size: int,
        exclude_seen: bool,
    ):
        self.items, self.num_items, self.num_users = items, num_items, users
        self.history, self.build_batch = history, build_batch
        self.batch_size, self.exclude_seen = batch_size, exclude_seen
        self._chunks: dict[tuple[str, str], list[EvalChunk]] = {}

    def eval_users(self) -> torch.Tensor:
        return torch.arange(self.num_users)

    def targets(self, users: torch.Tensor, split: str) -> torch.Tensor:
        starts, lengths = self.history(users, split)
        return self.items[starts + lengths]

    def eval_batch(self, users: torch.Tensor, split: str) -> Batch:
        """What the model reads to rank ``split``'s targets of ``users`` (no negatives)."""
        if split not in SPLITS:
            raise ValueError(f"split must be 'valid' or 'test', got {split!r}")
        return self.build_batch(users, split, torch.empty(users.numel(), 0, dtype=torch.long), users)

    def seen_items(self, users: torch.Tensor, split: str) -> torch.Tensor:
        """``[B, M]`` ids of the items the model reads for ``split`` (its input history), ``-1`` pads."""
        starts, lengths = self.history(users, split)
        return padded_items(self.items[gather_rows(starts, lengths, torch.arange(users.numel()))], lengths)

    def chunks(self, split: str, device: torch.device) -> list[EvalChunk]:
        """The split's batches on ``device``, built at the first call and kept for the later ones."""
        key = (split, str(device))
        if key not in self._chunks:
            self._chunks[key] = [
                EvalChunk(
                    batch=self.eval_batch(users, split).to(device),
                    targets=self.targets(users, split).to(device),
                    seen=self.seen_items(users, split).to(device) if self.exclude_seen else None,
                )
                for users in self.eval_users().split(self.batch_size)
            ]
        return self._chunks[key]

    def evaluate(self, model: nn.Module, *, device: torch.device, split: str) -> dict[str, float]:
        """The metrics of ``split`` (needs an unsharded item table; :func:`evaluate_chunks`)."""
        return evaluate_chunks(model, self.chunks(split, device), num_items=self.num_items,
                               exclude_seen=self.exclude_seen, device=device, split=split)  # fmt: skip
