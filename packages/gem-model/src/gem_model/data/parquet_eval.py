"""The ``parquet`` source's held-out evaluation (``data.source.options.evaluation``).

Each split (``valid``, ``test``) is Parquet with the training data's columns plus ``target``, one row
per user: the history the model reads and the item it is asked to rank among every item (HR@K,
NDCG@K, :mod:`gem_model.data.holdout`). The rows are read in file order, ``batch_size`` at a time,
with the training reader's checks (ids in their tables, nulls, times before the request); the
target must be an item id. ``gem-train data convert movielens_1m`` writes both splits, so the copy
evaluates as ``movielens_1m`` does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from gem_model.data import parquet_decode as dec
from gem_model.data.batch import build_batch
from gem_model.data.holdout import EvalChunk, evaluate_chunks, padded_items
from gem_model.data.parquet_schema import ParquetConfig, ParquetDataError


class SplitReader(dec.RowGroupSource, Protocol):
    """What the evaluation reads of a split's :class:`~gem_model.data.parquet.ParquetSource`."""

    files: list[Path]
    _handles: list[Any]
    num_rows: int

    def _locate(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

SPLITS = ("valid", "test")


class ParquetHoldout:
    """The configured splits, each read by a :class:`ParquetSource` of its own (built now: a missing
    file or column fails before training)."""

    def __init__(self, config: ParquetConfig, source_of: Callable[[ParquetConfig], SplitReader]):
        ev = config.evaluation
        assert ev is not None
        self.config, self.evaluation = config, ev
        paths = {"valid": ev.valid, "test": ev.test}
        self.sources = {
            split: source_of(config.model_copy(update={"path": path, "evaluation": None, "shuffle": "none"}))
            for split, path in paths.items() if path is not None
        }  # fmt: skip
        for split, source in self.sources.items():
            for path, handle in zip(source.files, source._handles, strict=True):
                schema = handle.schema_arrow
                if ev.target not in schema.names:
                    raise ParquetDataError(f"{path}: column {ev.target!r} (evaluation.target of the {split} split, "
                                           f"data.source.options) is missing; the file has columns {sorted(schema.names)}")  # fmt: skip
        self._chunks: dict[tuple[str, str], list[EvalChunk]] = {}

    def chunks(self, split: str, device: torch.device) -> list[EvalChunk]:
        """The split's batches on ``device``, built at the first call and kept for the later ones."""
        key = (split, str(device))
        if key not in self._chunks:
            source = self.sources[split]
            batches = torch.arange(source.num_rows).split(self.evaluation.batch_size)
            self._chunks[key] = [self._chunk(source, rows, device) for rows in batches]
        return self._chunks[key]

    def _chunk(self, source: SplitReader, rows: torch.Tensor, device: torch.device) -> EvalChunk:
        c = self.config
        group, local = source._locate(rows)
        parts = dec.take_rows(source, group, local, c.max_len)
        targets = torch.empty(rows.numel(), dtype=torch.long)
        for g in torch.unique(group).tolist():
            mask = group == g
            targets[mask] = dec.scalar_ints(source, g, self.evaluation.target, c.num_items)[local[mask]]
        b = rows.numel()
        times = None if parts["times"] is None else (parts["times"], parts["request_times"])
        batch = build_batch(
            history=(parts["items"], parts["lengths"]),
            actions=parts["actions"] if parts["actions"] is not None else torch.ones_like(parts["items"]),
            negatives=torch.empty(b, 0, dtype=torch.long),
            candidates=parts["candidates"],
            pooled=parts["pooled"],
            dense=parts["dense"],
            labels=parts["labels"],
            sample_ids=rows,
            times=times,
        )
        seen = padded_items(parts["items"], parts["lengths"]).to(device) if self.evaluation.exclude_seen else None
        return EvalChunk(batch=batch.to(device), targets=targets.to(device), seen=seen)

    def evaluate(self, model: nn.Module, *, device: torch.device, split: str) -> dict[str, float] | None:
        if split not in self.sources:
            return None
        return evaluate_chunks(model, self.chunks(split, device), num_items=self.config.num_items,
                               exclude_seen=self.evaluation.exclude_seen, device=device, split=split)  # fmt: skip
