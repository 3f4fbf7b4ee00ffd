"""What the planner plans: the model's sizes, its tables, the data's lengths and the batch.

Plain numbers, so a planner can be run for a model that no machine here could build (a dense part
of billions of parameters, tables of a trillion); :func:`workload_of` reads them off a real run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from gem_model.api import RunShape


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TableSpec(Strict):
    """One embedding table and how much of it a sample looks up."""

    name: str
    num_rows: int = Field(gt=0)
    dim: int = Field(gt=0)
    kind: Literal["sequence", "pooled"] = Field(
        "pooled", description="sequence: one embedding per looked-up id (EmbeddingCollection); pooled: one per sample"
    )
    ids_per_sample: float | None = Field(
        None, gt=0, description="ids a sample looks up; None for a sequence table: the mean sequence length"
    )

    @property
    def params(self) -> int:
        return self.num_rows * self.dim


class LengthProfile(Strict):
    """The distribution of sequence lengths, by its first two moments and its maximum."""

    mean: float = Field(gt=0)
    mean_square: float = Field(gt=0)
    max: int = Field(gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> LengthProfile:
        if self.mean_square < self.mean**2 * (1 - 1e-9) or self.mean > self.max:
            raise ValueError(f"mean {self.mean}, mean of squares {self.mean_square} and max {self.max} are inconsistent")
        return self

    @classmethod
    def of(cls, lengths: Sequence[int]) -> LengthProfile:
        n = len(lengths)
        if not n:
            raise ValueError("no lengths to describe")
        return cls(mean=sum(lengths) / n, mean_square=sum(x * x for x in lengths) / n, max=max(lengths))

    @classmethod
    def zipf(cls, alpha: float, max_len: int) -> LengthProfile:
        """Lengths 1..max_len with probability proportional to ``len ** -alpha``."""
        w = [k**-alpha for k in range(1, max_len + 1)]
        z = sum(w)
        mean = sum(k * p for k, p in enumerate(w, 1)) / z
        mean_square = sum(k * k * p for k, p in enumerate(w, 1)) / z
        return cls(mean=mean, mean_square=mean_square, max=max_len)


class Workload(Strict):
    """The model and the step the planner places."""

    num_layers: int = Field(ge=1, description="HSTU blocks")
    dense_params_per_layer: int = Field(gt=0, description="parameters of one HSTU block")
    other_dense_params: int = Field(0, ge=0, description="dense parameters outside the blocks (towers, heads)")
    embedding_dim: int = Field(gt=0, description="width of the residual stream")
    num_heads: int = Field(ge=1)
    attention_dim: int = Field(gt=0, description="Dqk per head")
    value_dim: int = Field(gt=0, description="Dv per head")
    tables: tuple[TableSpec, ...]
    lengths: LengthProfile
    global_batch_size: int = Field(gt=0, description="samples per step over all data-parallel ranks")
    param_bytes: int = Field(4, gt=0, description="bytes of a dense master weight (fp32)")
    comm_param_bytes: int = Field(2, gt=0, description="bytes per parameter in FSDP all-gathers (bf16)")
    grad_reduce_bytes: int = Field(4, gt=0, description="bytes per gradient element in reductions (fp32)")
    optimizer_bytes_per_param: int = Field(8, ge=0, description="dense optimizer state (AdamW: two fp32 moments)")
    activation_bytes: int = Field(2, gt=0, description="bytes per activation element (bf16)")
    saved_activations_per_token_per_layer: int = Field(
        16, gt=0, description="activation elements per token and embedding dim each block keeps for backward"
    )
    table_bytes: int = Field(4, gt=0, description="bytes per table element (fp32 weights)")
    table_optimizer_bytes_per_row: int = Field(4, ge=0, description="row-wise Adagrad: one fp32 per row")
    ids_bytes: int = Field(8, gt=0, description="bytes per looked-up id in the input all-to-all (int64)")
    table_sync_every: int = Field(
        100, ge=1, description="steps between the weight syncs of the table replicas across sparse groups"
    )

    @model_validator(mode="after")
    def _unique_tables(self) -> Workload:
        names = [t.name for t in self.tables]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"tables: names {dup} appear more than once")
        if not self.tables:
            raise ValueError("tables: at least one table is needed")
        return self

    @property
    def dense_params(self) -> int:
        return self.num_layers * self.dense_params_per_layer + self.other_dense_params

    @property
    def table_params(self) -> int:
        return sum(t.params for t in self.tables)

    def ids_per_sample(self, table: TableSpec) -> float:
        if table.ids_per_sample is not None:
            return table.ids_per_sample
        return self.lengths.mean if table.kind == "sequence" else 1.0

    def table_storage_bytes(self, table: TableSpec) -> float:
        return table.num_rows * (table.dim * self.table_bytes + self.table_optimizer_bytes_per_row)

    @property
    def total_table_bytes(self) -> float:
        return sum(self.table_storage_bytes(t) for t in self.tables)


def gem_sized(*, global_batch_size: int, pooled_tables: int = 24, max_len: int = 4096) -> Workload:
    """A GEM-sized model: 24 HSTU blocks of width 2048 (32 heads of 128), 1.1B dense parameters;
    an item table of 2B rows and ``pooled_tables`` tables of 200M rows (1.13T table parameters
    with the default 24), sequence lengths Zipf(1.2) up to ``max_len``."""
    d, heads, dh = 2048, 32, 128
    return Workload(
        num_layers=24,
        dense_params_per_layer=d * heads * 4 * dh + heads * dh * d,  # uvqk and output projections
        other_dense_params=100_000_000,
        embedding_dim=d,
        num_heads=heads,
        attention_dim=dh,
        value_dim=dh,
        tables=(
            TableSpec(name="item", num_rows=2_000_000_000, dim=256, kind="sequence"),
            TableSpec(name="action", num_rows=1_000, dim=256, kind="sequence"),
            *(TableSpec(name=f"feature_{i}", num_rows=200_000_000, dim=128) for i in range(pooled_tables)),
        ),
        lengths=LengthProfile.zipf(1.2, max_len),
        global_batch_size=global_batch_size,
    )


def workload_of(run: RunShape, *, activation_bytes: int, table_sync_every: int = 1, batches: int = 8) -> Workload:
    """The workload of a real run: its model's sizes (built on the meta device), its tables, the
    lengths of its data's first ``batches`` global batches, its global batch.

    ``activation_bytes``: 2 for a bfloat16 run, 4 for float32. ``table_sync_every``: ``fsdp``
    averages the table replicas of its sparse groups after every step (1)."""
    model = run.model()
    blocks = model.activation_blocks()
    dense = sum(p.numel() for _, p in model.dense_named_parameters())
    per_block = sum(p.numel() for p in model.get_submodule(blocks[0]).parameters()) if blocks else 0  # type: ignore[attr-defined]
    lengths = run.history_lengths(batches)
    profile = LengthProfile.of([max(int(n), 1) for n in lengths.tolist()])
    spec = run.feature_spec
    negatives = 0.0
    if spec is not None:
        per_position = spec.negatives_per_position
        negatives = spec.num_negatives * (max(profile.mean - 1.0, 0.0) if per_position else 1.0)
    tables = []
    for cfg in model.table_configs():
        sequence = "Bag" not in type(cfg).__name__
        ids = None
        if sequence:
            ids = profile.mean + (1.0 + negatives if cfg.name == "item" else 0.0)  # history, candidate, negatives
        tables.append(TableSpec(name=cfg.name, num_rows=cfg.num_embeddings, dim=cfg.embedding_dim,
                                kind="sequence" if sequence else "pooled", ids_per_sample=ids))  # fmt: skip
    mc = run.config.model
    return Workload(
        num_layers=max(len(blocks), 1),
        dense_params_per_layer=max(per_block, 1),
        other_dense_params=max(dense - len(blocks) * per_block, 0),
        embedding_dim=mc.embedding_dim,
        num_heads=mc.num_heads,
        attention_dim=mc.attention_dim,
        value_dim=mc.value_dim,
        tables=tuple(tables),
        lengths=profile,
        global_batch_size=run.global_batch_size,
        activation_bytes=activation_bytes,
        comm_param_bytes=4,  # FSDP2 all-gathers the float32 masters (MixedPrecisionPolicy(param_dtype=None))
        table_sync_every=table_sync_every,
    )
