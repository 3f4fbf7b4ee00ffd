"""The five named parallel dimensions of a GEM run, and their checks before any process starts.

The dense part runs on a 4-D mesh whose degrees multiply to the world size:

- ``dp_replicate``: HSDP replicas of the dense part (gradients all-reduced across them);
- ``dp_shard``: FSDP2 shards of the dense part (parameters all-gathered, gradients reduce-scattered);
- ``tp``: tensor parallelism inside the HSTU blocks (heads split; ranks of a group read the same samples);
- ``cp``: context parallelism (each long jagged sequence split over the ranks of a group).

The fifth, ``sparse``, is torchrec's 2-D sparse parallelism over the same ranks: the world is cut
into ``world / sparse`` groups of ``sparse`` ranks, the tables are sharded within a group and
replicated across groups (torchrec's ``DMPCollection(sharding_group_size=sparse)``). So ``sparse``
divides the world size rather than multiplying it; every rank looks up the ids of its own samples.

The data-parallel degree (how many different sample shards a step reads) is
``dp_replicate * dp_shard``; the samples of one data-parallel rank are shared by its ``tp * cp`` ranks.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gem_model.errors import ConfigError

DimName = Literal["dp_replicate", "dp_shard", "tp", "cp", "sparse"]
DenseDimName = Literal["dp_replicate", "dp_shard", "tp", "cp"]
DIM_NAMES: tuple[DimName, ...] = ("dp_replicate", "dp_shard", "tp", "cp", "sparse")
DENSE_DIMS: tuple[DenseDimName, ...] = ("dp_replicate", "dp_shard", "tp", "cp")


class ParallelDims(BaseModel):
    """Degrees of the five dimensions. Each is at least 1; the four dense ones multiply to the world size
    and ``sparse`` divides it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp_replicate: int = Field(1, ge=1, description="HSDP replicas of the dense part")
    dp_shard: int = Field(1, ge=1, description="FSDP2 shards of the dense part")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks in the HSTU blocks (must divide model.num_heads)")
    cp: int = Field(1, ge=1, description="context-parallel ranks per sequence (2 * cp must divide model.max_seq_len)")
    sparse: int = Field(1, ge=1, description="ranks of one torchrec sharding group of the tables (divides the world size)")

    def degree(self, name: DimName) -> int:
        return int(getattr(self, name))

    @property
    def world_size(self) -> int:
        return math.prod(self.degree(n) for n in DENSE_DIMS)

    @property
    def dp_degree(self) -> int:
        """Ranks that read different samples: ``dp_replicate * dp_shard``."""
        return self.dp_replicate * self.dp_shard

    @property
    def sparse_replicas(self) -> int:
        """Copies of the tables: one per sparse group."""
        return self.world_size // self.sparse

    def enabled(self) -> tuple[DimName, ...]:
        return tuple(n for n in DIM_NAMES if self.degree(n) > 1)

    def describe(self) -> str:
        return " x ".join(f"{n}={self.degree(n)}" for n in DIM_NAMES)

    def check(
        self,
        *,
        world_size: int,
        num_heads: int,
        global_batch_size: int,
        max_seq_len: int,
        prefix: str = "parallel.dims",
    ) -> None:
        """Raise :class:`~gem_model.errors.ConfigError` listing every degree that does not fit the run.

        Called before any process starts, from numbers the config already has.
        """
        problems: list[tuple[str, object, str]] = []
        if self.world_size != world_size:
            problems.append(
                (
                    f"{prefix}.dp_replicate x dp_shard x tp x cp",
                    self.describe(),
                    f"the dense degrees multiply to {self.world_size}, the world size is {world_size}",
                )
            )
        if world_size % self.sparse:
            problems.append(
                (f"{prefix}.sparse", self.sparse, f"must divide the world size {world_size} (groups of sparse ranks)")
            )
        if num_heads % self.tp:
            problems.append((f"{prefix}.tp", self.tp, f"must divide model.num_heads={num_heads} (heads are split over tp)"))
        if self.cp > 1 and max_seq_len % (2 * self.cp):
            problems.append(
                (f"{prefix}.cp", self.cp, f"2 * cp must divide model.max_seq_len={max_seq_len} (head-tail chunks of each sequence)")
            )
        if global_batch_size % self.dp_degree:
            problems.append(
                (
                    f"{prefix}.dp_replicate x dp_shard",
                    self.dp_degree,
                    f"the data-parallel degree must divide data.global_batch_size={global_batch_size}",
                )
            )
        if problems:
            raise ConfigError(problems)


SparseGroups = Literal["contiguous", "strided"]


class MeshOrder(BaseModel):
    """The order of the dense dimensions in the device mesh, outermost first, and how the sparse
    groups are cut from the ranks.

    Consecutive global ranks differ in the innermost dimension, so the innermost dimensions whose
    degrees multiply to at most the GPUs per node stay inside a node (NVLink). ``sparse_groups``:
    ``contiguous`` groups are runs of consecutive ranks (the replicas of a shard are ``sparse``
    apart); ``strided`` groups take every ``world / sparse``-th rank (the replicas are neighbours:
    torchrec's default, whose replica all-reduce stays inside a node).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    outer_to_inner: tuple[DenseDimName, ...] = Field(
        ("dp_replicate", "dp_shard", "cp", "tp"), description="a permutation of the four dense dimension names"
    )
    sparse_groups: SparseGroups = "contiguous"

    @model_validator(mode="after")
    def _permutation(self) -> MeshOrder:
        if sorted(self.outer_to_inner) != sorted(DENSE_DIMS):
            raise ValueError(f"outer_to_inner must name each of {list(DENSE_DIMS)} once, got {list(self.outer_to_inner)}")
        return self

    def strides(self, dims: ParallelDims) -> dict[DimName, int]:
        """Global-rank distance between neighbours along each dimension (``sparse``: within a group)."""
        stride, out = 1, {}
        for name in reversed(self.outer_to_inner):
            out[name] = stride
            stride *= dims.degree(name)
        out["sparse"] = 1 if self.sparse_groups == "contiguous" else stride // dims.sparse
        return out

    def coordinates(self, rank: int, dims: ParallelDims) -> dict[DimName, int]:
        """This rank's position along each dimension (``sparse``: its rank within its sparse group)."""
        strides = self.strides(dims)
        return {n: (rank // strides[n]) % dims.degree(n) for n in DIM_NAMES}
