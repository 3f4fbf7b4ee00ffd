"""Arrow columns of one row group to checked tensors, and this rank's rows out of decoded row groups.

Every check names the file, row group, column and row through :meth:`RowGroupSource.where`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from gem_model.data.parquet_schema import ParquetConfig, ParquetDataError
from gem_model.jagged import gather_rows, offsets_of


@dataclass
class Decoded:
    """One row group's columns as tensors. Jagged columns are (values, lengths)."""

    lengths: torch.Tensor
    items: torch.Tensor
    actions: torch.Tensor | None
    times: torch.Tensor | None
    request_times: torch.Tensor | None
    candidates: torch.Tensor | None
    pooled: dict[str, tuple[torch.Tensor, torch.Tensor]]
    dense: torch.Tensor
    labels: torch.Tensor
    offsets: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = offsets_of(self.lengths)


class RowGroupSource(Protocol):
    """What decoding needs of a Parquet source (:class:`gem_model.data.parquet.ParquetSource`)."""

    config: ParquetConfig

    def where(self, g: int, column: str | None = None, row: int | None = None) -> str: ...
    def read_column(self, g: int, column: str) -> Any: ...
    def column_type(self, g: int, column: str) -> Any: ...
    def decoded(self, g: int) -> Decoded: ...


def _tensor(array: Any, dtype: Any) -> torch.Tensor:
    """An Arrow array (no nulls) as a writable tensor of ``dtype`` (numpy dtype)."""
    out = np.asarray(array.to_numpy(zero_copy_only=False), dtype=dtype)
    if not out.flags.writeable:
        out = out.copy()
    return torch.from_numpy(out)


def _first_null(array: Any) -> int:
    return int(np.flatnonzero(array.is_null().to_numpy(zero_copy_only=False))[0])


def _no_nulls(src: RowGroupSource, g: int, column: str, array: Any) -> None:
    if array.null_count:
        raise ParquetDataError(f"{src.where(g, column, _first_null(array))}: null (nulls are not allowed)")


def _check_range(
    src: RowGroupSource, g: int, column: str, values: torch.Tensor, bound: int | None, offsets: torch.Tensor | None
) -> None:
    """Ids must lie in ``[0, bound)``; ``bound`` None: any value (times)."""
    if bound is None or values.numel() == 0:
        return
    bad = (values < 0) | (values >= bound)
    if bool(bad.any()):
        at = int(torch.nonzero(bad)[0, 0])
        row = at if offsets is None else int(torch.searchsorted(offsets, torch.tensor(at), right=True)) - 1
        raise ParquetDataError(
            f"{src.where(g, column, row)}: id {int(values[at])} is outside [0, {bound - 1}] "
            f"(the table has {bound} rows; see data.source.options)"
        )


def _list(src: RowGroupSource, g: int, column: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(flat values as int64, lengths) of a list column; no null lists, no null values."""
    import pyarrow.compute as pc

    array = src.read_column(g, column)
    _no_nulls(src, g, column, array)
    lengths = _tensor(pc.list_value_length(array), np.int64)
    flat = array.flatten()
    if flat.null_count:
        at = _first_null(flat)
        row = int(torch.searchsorted(offsets_of(lengths), torch.tensor(at), right=True)) - 1
        raise ParquetDataError(f"{src.where(g, column, row)}: a null in the list (nulls are not allowed)")
    return _tensor(flat, np.int64), lengths, flat


def id_list(src: RowGroupSource, g: int, column: str, bound: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    values, lengths, _ = _list(src, g, column)
    _check_range(src, g, column, values, bound, offsets_of(lengths))
    return values, lengths


def same_lengths(src: RowGroupSource, g: int, column: str, lengths: torch.Tensor, bound: int | None) -> torch.Tensor:
    """The values of a per-event list column, whose lists must be as long as the history's."""
    values, own, _ = _list(src, g, column)
    if not torch.equal(own, lengths):
        row = int(torch.nonzero(own != lengths)[0, 0])
        raise ParquetDataError(
            f"{src.where(g, column, row)}: {int(own[row])} values, but the history has {int(lengths[row])} events "
            f"(column {src.config.columns.history_item!r})"
        )
    _check_range(src, g, column, values, bound, offsets_of(lengths))
    return values


def check_length_column(src: RowGroupSource, g: int, column: str, stored: torch.Tensor, lengths: torch.Tensor) -> None:
    if not torch.equal(stored, lengths):
        row = int(torch.nonzero(stored != lengths)[0, 0])
        raise ParquetDataError(
            f"{src.where(g, column, row)}: says {int(stored[row])}, but the history has {int(lengths[row])} events"
        )


def check_times_before_requests(
    src: RowGroupSource, g: int, times: torch.Tensor, lengths: torch.Tensor, requests: torch.Tensor
) -> None:
    """Every event's time is at most its row's request time: an event after the request the row
    predicts from is a leak or a corrupt value (e.g. 6.5e18)."""
    if times.numel() == 0:
        return
    late = times > torch.repeat_interleave(requests, lengths, output_size=times.numel())
    if bool(late.any()):
        at = int(torch.nonzero(late)[0, 0])
        row = int(torch.searchsorted(offsets_of(lengths), torch.tensor(at), right=True)) - 1
        cols = src.config.columns
        raise ParquetDataError(
            f"{src.where(g, cols.history_time, row)}: time {int(times[at])} is after the row's request time "
            f"{int(requests[row])} (column {cols.request_time!r}): an event after the request it predicts from"
        )


def scalar_ints(src: RowGroupSource, g: int, column: str, bound: int | None) -> torch.Tensor:
    array = src.read_column(g, column)
    _no_nulls(src, g, column, array)
    values = _tensor(array, np.int64)
    _check_range(src, g, column, values, bound, None)
    return values


def ids_or_bag(src: RowGroupSource, g: int, column: str, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, lengths) of a pooled feature stored as one id per row or as a list of ids."""
    import pyarrow as pa

    kind = src.column_type(g, column)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return id_list(src, g, column, bound)
    values = scalar_ints(src, g, column, bound)
    return values, torch.ones_like(values)


def float_matrix(
    src: RowGroupSource, g: int, columns: list[str], n: int, *, finite: bool = False, unit: bool = False
) -> torch.Tensor:
    """``[n, len(columns)]`` float32; ``finite``: no NaN/Inf; ``unit``: every value in [0, 1] (labels)."""
    out = torch.empty(n, len(columns), dtype=torch.float32)
    for j, column in enumerate(columns):
        array = src.read_column(g, column)
        _no_nulls(src, g, column, array)
        values = _tensor(array, np.float32)
        bad = ~torch.isfinite(values) if finite else (values < 0) | (values > 1) if unit else None
        if bad is not None and bool(bad.any()):
            row = int(torch.nonzero(bad)[0, 0])
            allowed = "a finite number" if finite else "a label in [0, 1]"
            raise ParquetDataError(f"{src.where(g, column, row)}: value {float(values[row])} is not {allowed}")
        out[:, j] = values
    return out


def _take_jagged(values: torch.Tensor, offsets: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return values[gather_rows(offsets, lengths, rows)]


def take_rows(src: RowGroupSource, group: torch.Tensor, local: torch.Tensor, max_len: int) -> dict[str, Any]:
    """The rows ``(group[i], local[i])`` in the given order, histories cut to their last ``max_len`` events."""
    order = torch.argsort(group, stable=True)
    pieces: dict[str, list[torch.Tensor]] = {}
    pooled: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {p.feature: [] for p in src.config.pooled}

    def add(key: str, value: torch.Tensor | None) -> None:
        if value is not None:
            pieces.setdefault(key, []).append(value)

    for g in torch.unique_consecutive(group[order]).tolist():
        d = src.decoded(g)
        rows = local[order][group[order] == g]
        kept = torch.clamp(d.lengths[rows], max=max_len)
        starts = d.offsets[rows] + d.lengths[rows] - kept  # the most recent events
        flat = gather_rows(starts, kept, torch.arange(rows.numel()))
        add("lengths", kept)
        add("items", d.items[flat])
        add("actions", None if d.actions is None else d.actions[flat])
        add("times", None if d.times is None else d.times[flat])
        add("request_times", None if d.request_times is None else d.request_times[rows])
        add("candidates", None if d.candidates is None else d.candidates[rows])
        add("dense", d.dense[rows])
        add("labels", d.labels[rows])
        for feature, (values, lengths) in d.pooled.items():
            bag = lengths[rows]
            pooled[feature].append((_take_jagged(values, offsets_of(lengths), lengths, rows), bag))
    # back from group order to the order asked for
    back = torch.argsort(order)
    lengths = torch.cat(pieces["lengths"])
    seq = gather_rows(offsets_of(lengths), lengths, back)
    out: dict[str, Any] = {"lengths": lengths[back]}
    for key in ("items", "actions", "times"):
        out[key] = torch.cat(pieces[key])[seq] if key in pieces else None
    for key in ("request_times", "candidates", "dense", "labels"):
        out[key] = torch.cat(pieces[key])[back] if key in pieces else None
    out["pooled"] = {}
    for feature, parts in pooled.items():
        values, bags = torch.cat([v for v, _ in parts]), torch.cat([b for _, b in parts])
        out["pooled"][feature] = (values[gather_rows(offsets_of(bags), bags, back)], bags[back])
    return out
