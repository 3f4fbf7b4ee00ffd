"""The parallel degrees of a run, the order of its device mesh, and every check of them.

TorchTitan's ``ParallelDims``: one value holds the degrees, and every constraint they must meet is
checked here, before any process starts (:meth:`ParallelDims.problems`). A planner chooses them
(:meth:`ParallelPlanner.dims <gem_model.components.ParallelPlanner.dims>`); the run's
:class:`~gem_model.layout.Layout` is their runtime view (mesh, groups, this rank's coordinates).

The four mesh dims, TorchTitan's names, outermost first by default:

- ``dp_replicate``: replicas of the dense part (DDP, or HSDP's replica groups): gradients
  all-reduced across them;
- ``dp_shard``: shards of the dense part (FSDP2): parameters all-gathered, gradients reduce-scattered;
- ``cp``: context parallelism: each sequence's rows split over the ranks of a group;
- ``tp``: tensor parallelism: the HSTU blocks' heads split over the ranks of a group.

Their degrees multiply to the world size. The data-parallel degree (how many different shares of the
global batch a step reads) is ``dp_replicate x dp_shard``; the ranks of one ``cp`` or ``tp`` group
read the same samples, and the loss sums reduce over the data x context ranks.

The fifth, ``sparse``, is torchrec's 2-D sparse parallelism over the same ranks: the world is cut
into ``world / sparse`` groups of ``sparse`` ranks; the tables are sharded within a group and
replicated across groups. It divides the world size rather than multiplying it; ``sparse = 1``:
every rank holds every table.

Consecutive global ranks differ in the innermost mesh dim, so the innermost dims whose degrees
multiply to at most the GPUs of a node stay on NVLink (:attr:`ParallelDims.mesh_order`).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gem_model.errors import ConfigError

MeshDim = Literal["dp_replicate", "dp_shard", "cp", "tp"]
MESH_DIMS: tuple[MeshDim, ...] = ("dp_replicate", "dp_shard", "cp", "tp")
DATA_DIMS: tuple[MeshDim, ...] = ("dp_replicate", "dp_shard")
LOSS_DIMS: tuple[MeshDim, ...] = (*DATA_DIMS, "cp")
SparseGroups = Literal["contiguous", "strided"]
SPARSE_GROUP = "sparse"
SPARSE_REPLICA_GROUP = "sparse_replica"
"""The keys of the two sparse groups in :attr:`gem_model.layout.Layout.groups`: the ranks this
rank's tables are sharded over, and the ranks (one per sparse group) that hold the same shards."""

Problem = tuple[str, object, str]
"""(dotted config path, the bad value, what is wrong and what is allowed): a :class:`ConfigError` line."""


class ParallelDims(BaseModel):
    """The degrees of the five dims, the mesh order, and how the sparse groups are cut.

    ``dp_shard = 0`` and ``sparse = 0`` are filled from the world size by :meth:`resolve` (the ranks
    the other mesh dims leave; all ranks). A planner's ``Config`` may embed these fields as its own
    options (gem-parallel's ``fsdp`` does), so their paths are ``parallel.planner.options.<dim>``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp_replicate: int = Field(1, ge=1, description="replicas of the dense part (HSDP replica groups): gradients all-reduced across them")
    dp_shard: int = Field(0, ge=0, description="shards of the dense part (FSDP2); 0: the world size / (dp_replicate x cp x tp)")
    cp: int = Field(1, ge=1, description="context-parallel ranks: each sequence's rows split over them (head-tail chunks)")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks in the HSTU blocks: the heads split over them (must divide model.num_heads)")
    sparse: int = Field(
        0,
        ge=0,
        description="ranks of one sparse group: the tables are sharded within a group and replicated across the "
        "world / sparse groups (must divide the world size); 1: every rank holds every table; 0: all ranks, one group",
    )
    mesh_order: tuple[MeshDim, ...] = Field(
        MESH_DIMS,
        description="the mesh dims outermost first (each of dp_replicate, dp_shard, cp, tp once): consecutive ranks "
        "differ in the innermost, so the innermost dims stay inside a node",
    )
    sparse_groups: SparseGroups = Field(
        "contiguous",
        description="contiguous: a sparse group is a run of consecutive ranks (its replicas are sparse ranks apart); "
        "strided: every (world / sparse)-th rank (the replicas are neighbours, torchrec's default)",
    )

    @model_validator(mode="after")
    def _order_is_a_permutation(self) -> ParallelDims:
        if sorted(self.mesh_order) != sorted(MESH_DIMS):
            raise ValueError(f"mesh_order must name each of {list(MESH_DIMS)} once, got {list(self.mesh_order)}")
        return self

    # ------------------------------------------------------------------------------ the degrees

    @property
    def resolved(self) -> bool:
        """False while ``dp_shard`` or ``sparse`` is 0 (to be filled from the world size)."""
        return self.dp_shard > 0 and self.sparse > 0

    def resolve(self, world_size: int, *, where: str = "parallel.planner.options") -> ParallelDims:
        """These dims for ``world_size`` ranks: ``dp_shard = 0`` and ``sparse = 0`` filled in. A
        :class:`ConfigError` names the degrees (at ``where``) when they cannot fit ``world_size``
        ranks (``dp_shard`` cannot be filled, the mesh product is another, ``sparse`` does not divide it)."""
        update: dict[str, int] = {}
        if self.dp_shard == 0:
            others = self.dp_replicate * self.cp * self.tp
            rest, left = divmod(world_size, others)
            if left or not rest:
                raise ConfigError([(
                    f"{where}.dp_replicate x cp x tp", f"{self.dp_replicate} x {self.cp} x {self.tp}",
                    f"must divide the world size {world_size} (dp_shard takes the ranks they leave)",
                )])  # fmt: skip
            update["dp_shard"] = rest
        if self.sparse == 0:
            update["sparse"] = world_size
        dims = self.model_copy(update=update) if update else self
        wrong = dims._world_problems(world_size, where)
        if wrong:
            raise ConfigError(wrong)
        return dims

    def _world_problems(self, world_size: int, where: str) -> list[Problem]:
        out: list[Problem] = []
        product = math.prod(self.degree(d) for d in MESH_DIMS)
        if product != world_size:
            out.append((
                f"{where}.dp_replicate x dp_shard x cp x tp", str(self),
                f"the mesh degrees multiply to {product}, but the world size is {world_size}",
            ))  # fmt: skip
        if world_size % self.sparse:
            out.append((f"{where}.sparse", self.sparse, f"must divide the world size {world_size} (groups of sparse ranks)"))
        return out

    def _need_resolved(self) -> None:
        if not self.resolved:
            raise ValueError(f"the degrees {self} are not resolved yet: call resolve(world_size) first")

    def degree(self, dim: str) -> int:
        if dim not in (*MESH_DIMS, "sparse"):
            raise ValueError(f"unknown dim {dim!r}; allowed: {', '.join((*MESH_DIMS, 'sparse'))}")
        return int(getattr(self, dim))

    def enabled(self, dim: str) -> bool:
        """True when ``dim`` has more than one rank (``sparse``: when the tables are sharded over
        groups of more than one rank)."""
        return self.degree(dim) > 1

    @property
    def enabled_dims(self) -> tuple[MeshDim, ...]:
        """The mesh dims of degree above 1, in mesh order."""
        return tuple(d for d in self.mesh_order if self.degree(d) > 1)

    @property
    def world_size(self) -> int:
        self._need_resolved()
        return math.prod(self.degree(d) for d in MESH_DIMS)

    @property
    def dp_degree(self) -> int:
        """Ranks that read different samples: ``dp_replicate x dp_shard``."""
        self._need_resolved()
        return self.dp_replicate * self.dp_shard

    @property
    def loss_degree(self) -> int:
        """Ranks whose partial loss sums make up the global loss: ``dp_replicate x dp_shard x cp``."""
        return self.dp_degree * self.cp

    @property
    def sparse_replicas(self) -> int:
        """Copies of the tables: one per sparse group."""
        return self.world_size // self.sparse

    def mesh_dims(self, keep: tuple[str, ...] = ()) -> tuple[MeshDim, ...]:
        """The dims of a device mesh over these degrees, outermost first: the enabled ones and those in
        ``keep`` (a planner may keep a dim of degree 1, e.g. FSDP2's ``dp_shard`` beside
        ``dp_replicate``); with none, the first of ``keep`` or ``dp_replicate`` (one rank)."""
        dims = tuple(d for d in self.mesh_order if self.degree(d) > 1 or d in keep)
        return dims or ((keep[0],) if keep else ("dp_replicate",))  # type: ignore[return-value]

    # ---------------------------------------------------------------------------- rank geometry

    def strides(self) -> dict[str, int]:
        """Global-rank distance between neighbours along each dim (``sparse``: within a sparse group)."""
        self._need_resolved()
        stride, out = 1, {}
        for dim in reversed(self.mesh_order):
            out[dim] = stride
            stride *= self.degree(dim)
        out["sparse"] = 1 if self.sparse_groups == "contiguous" else stride // self.sparse
        return out

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index along each dim (row-major over the mesh order; ``sparse``: its index
        within its sparse group)."""
        strides = self.strides()
        return {d: (rank // strides[d]) % self.degree(d) for d in (*MESH_DIMS, "sparse")}

    def sparse_group_ranks(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s sparse group, in group order (torchrec's plan of a group
        names its ranks by their index here)."""
        stride = self.strides()["sparse"]
        if self.sparse_groups == "contiguous":
            first = rank // self.sparse * self.sparse
        else:
            first = rank % stride
        return [first + i * stride for i in range(self.sparse)]

    # ---------------------------------------------------------------------------------- checks

    def problems(
        self, *, world_size: int, num_heads: int, global_batch_size: int, max_seq_len: int,
        where: str = "parallel.planner.options",
    ) -> list[Problem]:  # fmt: skip
        """Every way these (resolved) degrees do not fit a run of ``world_size`` ranks, each with the
        dotted path of the degree (under ``where``) and the config field it must fit."""
        self._need_resolved()
        out = self._world_problems(world_size, where)
        if num_heads % self.tp:
            out.append((f"{where}.tp", self.tp, f"must divide model.num_heads = {num_heads} (the heads are split over tp)"))
        if self.cp > 1 and 2 * self.cp > max_seq_len:
            out.append((
                f"{where}.cp", self.cp,
                f"2 x cp must be at most model.max_seq_len = {max_seq_len}: each sequence is cut into 2 x cp head-tail "
                "chunks, and with fewer rows than chunks some cp ranks hold no row of any sequence",
            ))  # fmt: skip
        dp = self.dp_degree
        if global_batch_size % dp:
            out.append((
                "data.global_batch_size", global_batch_size,
                f"must divide evenly over the {dp} data-parallel ranks ({where}.dp_replicate x dp_shard = "
                f"{self.dp_replicate} x {self.dp_shard}) of {world_size} process(es)",
            ))  # fmt: skip
        return out

    def check(self, *, world_size: int, num_heads: int, global_batch_size: int, max_seq_len: int,
              where: str = "parallel.planner.options") -> None:  # fmt: skip
        """Raise one :class:`ConfigError` listing every :meth:`problems`."""
        found = self.problems(
            world_size=world_size, num_heads=num_heads, global_batch_size=global_batch_size, max_seq_len=max_seq_len,
            where=where,
        )  # fmt: skip
        if found:
            raise ConfigError(found)

    def __str__(self) -> str:
        return " x ".join(f"{d}={self.degree(d)}" for d in (*self.mesh_order, "sparse"))


def dims_of(options: BaseModel) -> ParallelDims:
    """The :class:`ParallelDims` fields of a planner's options that embed them (a ``Config`` that
    subclasses :class:`ParallelDims`), as a :class:`ParallelDims` of their own."""
    return ParallelDims.model_validate({name: getattr(options, name) for name in ParallelDims.model_fields})
