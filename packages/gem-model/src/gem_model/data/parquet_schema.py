"""The ``parquet`` source's config (which column is which feature) and the checks of a file's schema.

One row of a file is one sample. The columns, named by :class:`ParquetColumns` and the pooled, dense
and label lists of :class:`ParquetConfig`:

=====================  ==================  ==================================================
role                   Arrow type          meaning
=====================  ==================  ==================================================
``history_item``       list<integer>       the user's history, oldest first (required)
``history_action``     list<integer>       the action type of each event (same lengths)
``history_time``       list<integer>       the time of each event, integer seconds (same lengths)
``request_time``       integer             the time of the request the sample predicts after
``candidate``          integer             the candidate item of the task heads
pooled feature         integer or list     one id, or a bag of ids, of a non-sequence table
dense feature          floating            one float per column
label                  integer/float/bool  0 or 1 per task
``history_length``     integer             the length of ``history_item`` (optional; read first)
``target``             integer             (evaluation files only) the held-out item to rank
=====================  ==================  ==================================================

Any other column is ignored. Nulls are errors. Every event's time must be at most its row's
request time (an event after the request it predicts from is leaked or corrupt).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gem_model.components import ComponentConfig
from gem_model.errors import GemError

if TYPE_CHECKING:
    import pyarrow as pa

INSTALL_HINT = "pip install 'gem-model[parquet]'"


class ParquetDataError(GemError, ValueError):
    """A Parquet file, row group, column or row the ``parquet`` source cannot use; the message says where."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ParquetColumns(_Strict):
    """Column names of the sequence features; ``None`` where the data has no such column."""

    history_item: str = "history_item"
    history_action: str | None = Field(
        "history_action", description="None: every event has action 1 (then num_actions may be 2)"
    )
    history_time: str | None = Field("history_time", description="None: no times (needs request_time None too)")
    request_time: str | None = "request_time"
    candidate: str | None = Field(None, description="the candidate item id of the task heads; None: no candidate")
    history_length: str | None = Field(
        None,
        description="an integer column holding each row's history length: the lengths of a global batch are then "
        "read from it alone, before the rest of this rank's rows; None: from history_item",
    )

    @model_validator(mode="after")
    def _times_together(self) -> ParquetColumns:
        if (self.history_time is None) != (self.request_time is None):
            raise ValueError("columns.history_time and columns.request_time must both be set or both be None")
        return self


class PooledColumn(_Strict):
    """A non-sequence categorical feature: ``column`` holds one id or a list of ids per row."""

    feature: str
    column: str
    num_embeddings: int = Field(ge=1, description="rows of its table: ids lie in [0, num_embeddings)")
    pooling: Literal["sum", "mean"] = "sum"


class LabelColumn(_Strict):
    task: str
    column: str


class ParquetEvaluation(_Strict):
    """Held-out splits: files with the training data's columns plus ``target``, one row per user."""

    valid: str | None = Field(None, description="the validation split: a file, a folder of them or a glob; None: none")
    test: str | None = Field(None, description="the test split, as valid")
    target: str = Field("target", description="the integer column of the held-out item each row's history ranks")
    exclude_seen: bool = Field(
        True, description="the items of the row's history are not candidates (HSTU's and SASRec's evaluation); "
        "the unfiltered metrics are reported as well",
    )  # fmt: skip
    batch_size: int = Field(1024, ge=1, description="rows ranked at once")


class ParquetConfig(ComponentConfig):
    path: str = Field(description="a .parquet file, a folder of them (read in name order), or a glob")
    num_items: int = Field(ge=2, description="rows of the item table: item ids lie in [0, num_items)")
    num_actions: int = Field(2, ge=2, description="action types: ids lie in [0, num_actions)")
    max_len: int = Field(
        200, ge=1, description="longest history fed to the model: longer ones keep their most recent max_len events"
    )
    columns: ParquetColumns = Field(default_factory=ParquetColumns)
    pooled: list[PooledColumn] = Field(default_factory=list)
    dense: list[str] = Field(default_factory=list, description="float columns, in the order of the dense features")
    labels: list[LabelColumn] = Field(default_factory=list, description="one column per task, in task order")
    seed: int = 0
    shuffle: Literal["rows", "row_groups", "none"] = Field(
        "row_groups",
        description="the order of an epoch, seeded by (seed, epoch): rows: a permutation of all rows (what "
        "movielens_1m draws; a step then reads row groups from anywhere in the data); row_groups: the row "
        "groups in a permutation, the rows of each shuffle_window of them permuted together (a step reads a "
        "few neighbouring row groups); none: file order. The last batch of an epoch wraps around to its first rows",
    )
    shuffle_window: int = Field(4, ge=1, description="row groups whose rows are mixed, with shuffle: row_groups")
    num_negatives: int = Field(128, ge=1, description="uniform over the items, drawn from a generator seeded by (seed, step)")
    negatives_per: Literal["sample", "position"] = Field(
        "sample", description="num_negatives per sample, shared by its positions, or per predicted position"
    )
    cache_row_groups: int = Field(
        64, ge=1, description="decoded row groups kept in memory (a row group is decoded once while it is cached)"
    )
    evaluation: ParquetEvaluation | None = Field(
        None, description="held-out validation and test splits, ranked over the whole catalogue (HR@K, NDCG@K)"
    )

    @model_validator(mode="after")
    def _unique_names(self) -> ParquetConfig:
        features = [p.feature for p in self.pooled]
        tasks = [label.task for label in self.labels]
        for what, names in (("pooled feature", features), ("task", tasks), ("dense column", self.dense)):
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{what} names must be unique; repeated: {dup}")
        return self

    def sequence_columns(self) -> list[tuple[str, str]]:
        """(role, column) of every list column that has one value per event."""
        c = self.columns
        out = [("history_item", c.history_item)]
        out += [(role, name) for role, name in (("history_action", c.history_action), ("history_time", c.history_time)) if name]
        return out

    def all_columns(self) -> list[str]:
        c = self.columns
        names = [n for _, n in self.sequence_columns()]
        names += [n for n in (c.request_time, c.candidate, c.history_length) if n]
        names += [p.column for p in self.pooled] + list(self.dense) + [label.column for label in self.labels]
        return list(dict.fromkeys(names))


def _kind(t: pa.DataType) -> str:
    import pyarrow as pa

    if pa.types.is_integer(t):
        return "integer"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{_kind(t.value_type)}>"
    return str(t)


def expected_kinds(config: ParquetConfig) -> list[tuple[str, str, set[str]]]:
    """(column, what it is, the type kinds allowed) of every configured role (a column may have several)."""
    c = config.columns
    out = [(name, f"columns.{role}", {"list<integer>"}) for role, name in config.sequence_columns()]
    for role, name in (("request_time", c.request_time), ("candidate", c.candidate), ("history_length", c.history_length)):
        if name:
            out.append((name, f"columns.{role}", {"integer"}))
    out += [(p.column, f"pooled feature {p.feature!r}", {"integer", "list<integer>"}) for p in config.pooled]
    out += [(name, "a dense feature", {"float"}) for name in config.dense]
    out += [(label.column, f"the label of task {label.task!r}", {"integer", "float", "bool"}) for label in config.labels]
    return out


def check_schema(file: str, schema: pa.Schema, config: ParquetConfig) -> None:
    """Raise :class:`ParquetDataError` naming the file and column when a configured column is missing or mistyped."""
    present = set(schema.names)
    for column, what, kinds in expected_kinds(config):
        if column not in present:
            raise ParquetDataError(
                f"{file}: column {column!r} ({what}, data.source.options) is missing; the file has columns "
                f"{sorted(present)}"
            )
        kind = _kind(schema.field(column).type)
        if kind not in kinds:
            raise ParquetDataError(
                f"{file}: column {column!r} ({what}) has type {schema.field(column).type} ({kind}); "
                f"expected {' or '.join(sorted(kinds))}"
            )

