"""Logged data in Parquet files as a data source (``parquet``), read with pyarrow.

One row is one sample; which column is which feature is the config's
(:mod:`gem_model.data.parquet_schema` lists the roles and types). Every file's footer is read when the
source is built: a file that is not Parquet, or lacks a configured column, or has one of another type,
fails then, before training, with the file and column named.

Order. The rows of all files form one sequence (files in name order). Step ``s`` of a global batch of
``B`` reads positions ``s * B ... s * B + B - 1`` of its epoch (``ceil(rows / B)`` steps; the last batch
wraps around to the epoch's first rows), in the order ``shuffle`` says, seeded by ``(seed, epoch)``:
``rows``, a permutation of all rows (the one ``movielens_1m`` draws, so that a converted copy trains
identically; a step then reads row groups from anywhere); ``row_groups`` (the default), the row groups
permuted and the rows of every ``shuffle_window`` of them mixed (a step reads a few neighbouring row
groups: the order for data larger than the cache); ``none``, file order. Negatives are drawn uniformly from a generator seeded by ``(seed, step)``. So every
global batch is a pure function of the step, and a resumed run reads what an uninterrupted one would.

Reading. Row groups are read when a step needs them and kept decoded in a small cache
(``cache_row_groups``). The loader asks for the global batch's lengths first: they come from the
``history_length`` column alone when the config names one (one integer per row), else from the
history column. Then this rank's samples: only the row groups that hold one of its rows are read
(every configured column), and only its rows are taken from them. Parquet cannot decode less than a
column chunk of a row group, so a rank whose rows are spread over the batch (the round-robin
balancer) reads the batch's row groups; a balancer that hands out contiguous ranges reads its own.

Checks, while a row group is decoded: nulls, lists of one row whose lengths disagree, ids outside
their table, labels outside [0, 1], dense values that are not finite, an event time after its row's
request time. Each error names the file, the row group, the column and the row (within the row
group and within the whole data). An unreadable row group (truncated, corrupt: pages written with
checksums are verified) raises the same error type with pyarrow's message, never a crash. A page
written without a checksum (pyarrow's default) cannot be verified: damage there is caught only
where it breaks one of the checks above, which is why ``gem-train data convert`` writes checksums.

Evaluation: with ``evaluation``, held-out ``valid`` and ``test`` files are ranked over the whole
catalogue (:mod:`gem_model.data.parquet_eval`).
"""

from __future__ import annotations

import glob
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from gem_model.components import DataSource
from gem_model.data import parquet_decode as dec
from gem_model.data.batch import Batch, FeatureSpec, PooledFeature, build_batch
from gem_model.data.parquet_decode import Decoded
from gem_model.data.parquet_eval import ParquetHoldout
from gem_model.data.parquet_schema import INSTALL_HINT, ParquetConfig, ParquetDataError, check_schema
from gem_model.jagged import gather_rows, offsets_of


def import_pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ModuleNotFoundError as exc:
        raise ParquetDataError(f"the parquet data source needs pyarrow, which is not installed: {INSTALL_HINT}") from exc
    return pyarrow


def resolve_files(path: str) -> list[Path]:
    """The files ``path`` names: itself, the ``*.parquet`` files of a folder, or a glob's matches; sorted."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.parquet"))
    elif p.is_file():
        files = [p]
    else:
        files = sorted(Path(m) for m in glob.glob(path) if Path(m).is_file())
    if not files:
        raise ParquetDataError(f"data.source.options.path: {path!r} names no Parquet file (a file, a folder or a glob)")
    return files


@dataclass(frozen=True)
class RowGroup:
    file: int
    index: int
    first_row: int
    num_rows: int


class ParquetSource(DataSource):
    name: ClassVar[str] = "parquet"
    Config = ParquetConfig
    config: ParquetConfig

    def __init__(self, config: ParquetConfig | None = None):
        super().__init__(config)
        pa = import_pyarrow()
        self.files = resolve_files(self.config.path)
        self._handles = []
        groups: list[RowGroup] = []
        first = 0
        for i, path in enumerate(self.files):
            try:
                handle = pa.parquet.ParquetFile(path, page_checksum_verification=True)
            except (pa.ArrowException, OSError) as exc:
                raise ParquetDataError(f"{path}: not a readable Parquet file ({type(exc).__name__}: {exc})") from None
            check_schema(str(path), handle.schema_arrow, self.config)
            self._handles.append(handle)
            for rg in range(handle.num_row_groups):
                n = handle.metadata.row_group(rg).num_rows
                groups.append(RowGroup(i, rg, first, n))
                first += n
        self.groups = [g for g in groups if g.num_rows]
        self.num_rows = first
        if self.num_rows == 0:
            raise ParquetDataError(f"data.source.options.path: the files of {self.config.path!r} hold no rows")
        self._firsts = torch.tensor([g.first_row for g in self.groups], dtype=torch.long)
        self._decoded: OrderedDict[int, Decoded] = OrderedDict()
        self._lengths: OrderedDict[int, torch.Tensor] = OrderedDict()
        self._epoch: tuple[int, torch.Tensor] | None = None
        self._step: tuple[tuple[int, int], dict[str, torch.Tensor]] | None = None
        self.row_groups_read = 0
        """How many row groups were decoded (every configured column), for tests and benchmarks."""
        self.holdout = None if self.config.evaluation is None else ParquetHoldout(self.config, ParquetSource)
        """The held-out splits (``evaluation``), their files checked now."""

    def feature_spec(self) -> FeatureSpec:
        c = self.config
        return FeatureSpec(
            num_items=c.num_items,
            num_actions=c.num_actions,
            pooled=tuple(PooledFeature(p.feature, p.num_embeddings, p.pooling) for p in c.pooled),
            num_dense=len(c.dense),
            tasks=tuple(label.task for label in c.labels),
            num_negatives=c.num_negatives,
            max_history=c.max_len,
            negatives_per_position=c.negatives_per == "position",
            candidates=c.columns.candidate is not None,
            timestamps=c.columns.history_time is not None,
        )

    def steps_per_epoch(self, global_batch_size: int) -> int:
        return -(-self.num_rows // global_batch_size)

    # ------------------------------------------------------------------------------------- order

    def _permutation(self, epoch: int) -> torch.Tensor:
        """The rows of ``epoch`` in the order they are read (``shuffle`` rows or row_groups)."""
        if self._epoch is None or self._epoch[0] != epoch:
            g = torch.Generator().manual_seed(self.config.seed * 1_000_003 + epoch * 7_919 + 11)
            if self.config.shuffle == "rows":
                order = torch.randperm(self.num_rows, generator=g)
            else:
                windows = []
                for window in torch.randperm(len(self.groups), generator=g).split(self.config.shuffle_window):
                    rows = torch.cat([torch.arange(self.groups[i].num_rows) + self.groups[i].first_row for i in window.tolist()])
                    windows.append(rows[torch.randperm(rows.numel(), generator=g)])
                order = torch.cat(windows)
            self._epoch = (epoch, order)
        return self._epoch[1]

    def rows_of_step(self, step: int, global_batch_size: int) -> torch.Tensor:
        """Row numbers (over all files) of the global batch of ``step``."""
        epoch, first = divmod(step, self.steps_per_epoch(global_batch_size))
        positions = (first * global_batch_size + torch.arange(global_batch_size)) % self.num_rows
        return positions if self.config.shuffle == "none" else self._permutation(epoch)[positions]

    def _locate(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row group number, row within it) of each row."""
        group = torch.searchsorted(self._firsts, rows, right=True) - 1
        return group, rows - self._firsts[group]

    # ----------------------------------------------------------------------------------- reading

    def where(self, g: int, column: str | None = None, row: int | None = None) -> str:
        """``file, row group k[, column c][, row r (row n of the data)]`` for error messages."""
        grp = self.groups[g]
        out = f"{self.files[grp.file]}, row group {grp.index}"
        if column is not None:
            out += f", column {column!r}"
        if row is not None:
            out += f", row {row} (row {grp.first_row + row} of the data)"
        return out

    def column_type(self, g: int, column: str) -> Any:
        """The Arrow type of ``column`` in the file holding row group ``g``."""
        return self._handles[self.groups[g].file].schema_arrow.field(column).type

    def read_column(self, g: int, column: str) -> Any:
        """One column of row group ``g`` as one Arrow array; unreadable data raises :class:`ParquetDataError`."""
        pa = import_pyarrow()
        grp = self.groups[g]
        try:
            table = self._handles[grp.file].read_row_group(grp.index, columns=[column])
            array = table.column(0).combine_chunks()
        except (pa.ArrowException, OSError) as exc:
            raise ParquetDataError(
                f"{self.where(g, column)}: cannot be read ({type(exc).__name__}: {exc})"
            ) from None
        if len(array) != grp.num_rows:
            raise ParquetDataError(f"{self.where(g, column)}: {len(array)} values for {grp.num_rows} rows")
        return array

    def _cached(self, cache: OrderedDict[int, Any], g: int, build: Any) -> Any:
        if g in cache:
            cache.move_to_end(g)
            return cache[g]
        value = cache[g] = build(g)
        while len(cache) > self.config.cache_row_groups:
            cache.popitem(last=False)
        return value

    def decoded(self, g: int) -> Decoded:
        return self._cached(self._decoded, g, self._decode)

    def _decode(self, g: int) -> Decoded:
        c, cols = self.config, self.config.columns
        self.row_groups_read += 1
        items, lengths = dec.id_list(self, g, cols.history_item, c.num_items)
        per_event: dict[str, torch.Tensor | None] = {}
        for role, name, bound in (("actions", cols.history_action, c.num_actions), ("times", cols.history_time, None)):
            per_event[role] = None if name is None else dec.same_lengths(self, g, name, lengths, bound)
        if cols.history_length is not None:
            dec.check_length_column(self, g, cols.history_length, self._stored_lengths(g), lengths)
        pooled = {p.feature: dec.ids_or_bag(self, g, p.column, p.num_embeddings) for p in c.pooled}
        n = self.groups[g].num_rows
        requests = None if cols.request_time is None else dec.scalar_ints(self, g, cols.request_time, None)
        if per_event["times"] is not None and requests is not None:
            dec.check_times_before_requests(self, g, per_event["times"], lengths, requests)
        return Decoded(
            lengths=lengths,
            items=items,
            actions=per_event["actions"],
            times=per_event["times"],
            request_times=requests,
            candidates=None if cols.candidate is None else dec.scalar_ints(self, g, cols.candidate, c.num_items),
            pooled=pooled,
            dense=dec.float_matrix(self, g, c.dense, n, finite=True),
            labels=dec.float_matrix(self, g, [label.column for label in c.labels], n, unit=True),
        )

    def _stored_lengths(self, g: int) -> torch.Tensor:
        return self._cached(self._lengths, g, lambda g: dec.scalar_ints(self, g, self.config.columns.history_length, None))

    def _row_lengths(self, g: int) -> torch.Tensor:
        if self.config.columns.history_length is not None and g not in self._decoded:
            return self._stored_lengths(g)
        return self.decoded(g).lengths

    # ----------------------------------------------------------------------------- the interface

    def _global(self, step: int, b: int) -> dict[str, torch.Tensor]:
        if self._step is not None and self._step[0] == (step, b):
            return self._step[1]
        c = self.config
        rows = self.rows_of_step(step, b)
        group, local = self._locate(rows)
        full = torch.empty(b, dtype=torch.long)
        for g in torch.unique(group).tolist():
            mask = group == g
            full[mask] = self._row_lengths(g)[local[mask]]
        lengths = torch.clamp(full, max=c.max_len)
        rows_per = torch.clamp(lengths - 1, min=0) if c.negatives_per == "position" else torch.ones_like(lengths)
        gen = torch.Generator().manual_seed(c.seed * 1_000_003 + step * 7_919 + 17)
        negatives = torch.randint(c.num_items, (int(rows_per.sum()), c.num_negatives), generator=gen)
        data = {"group": group, "local": local, "lengths": lengths, "negatives": negatives, "neg_rows": rows_per}
        self._step = ((step, b), data)
        return data

    def lengths(self, step: int, global_batch_size: int) -> torch.Tensor:
        return self._global(step, global_batch_size)["lengths"].clone()

    def make_batch(self, step: int, global_batch_size: int, indices: torch.Tensor) -> Batch:

        c, d = self.config, self._global(step, global_batch_size)
        parts = dec.take_rows(self, d["group"][indices], d["local"][indices], c.max_len)
        rows, k = d["neg_rows"], c.num_negatives
        mine = gather_rows(offsets_of(rows), rows, indices)
        times = None if parts["times"] is None else (parts["times"], parts["request_times"])
        return build_batch(
            history=(parts["items"], parts["lengths"]),
            actions=parts["actions"] if parts["actions"] is not None else torch.ones_like(parts["items"]),
            negatives=(d["negatives"][mine].reshape(-1), rows[indices] * k),
            candidates=parts["candidates"],
            pooled=parts["pooled"],
            dense=parts["dense"],
            labels=parts["labels"],
            sample_ids=indices + step * global_batch_size,
            times=times,
        )


    def evaluate(self, model: torch.nn.Module, *, device: torch.device, split: str) -> dict[str, float] | None:
        """HR@K and NDCG@K of the ``evaluation`` split (:mod:`gem_model.data.parquet_eval`); None without one."""
        return None if self.holdout is None else self.holdout.evaluate(model, device=device, split=split)


__all__ = ["ParquetDataError", "ParquetSource", "resolve_files"]
