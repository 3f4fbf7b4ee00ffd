"""The runtime view of a run's :class:`~gem_model.parallel_dims.ParallelDims`: this rank's place, each dim's group.

A planner makes the layout (:meth:`ParallelPlanner.layout
<gem_model.components.ParallelPlanner.layout>`) once per run, before the loader exists, and
everything in the loop that depends on how the ranks are arranged reads it here, never ``world_size``:

- the loader shards the global batch by :attr:`Layout.dp_rank` over :attr:`Layout.dp_degree`;
- the loss (and the step's metric sums) reduce over :attr:`Layout.loss_group`, the data x context
  ranks, and the loss is normalised by :attr:`Layout.loss_degree`;
- MFU is per GPU: the FLOPs of the global batch over :attr:`Layout.world_size` devices.

The dims and their vocabulary are :mod:`gem_model.parallel_dims`'s. The layout's mesh has the dims
of :attr:`Layout.mesh_dims`, in the dims' mesh order: those of degree above 1, and any a planner
keeps at degree 1. Besides each mesh dim's group, ``groups`` may hold flattened groups (keyed
``"dp_shard+cp"`` and so on, in mesh order) and the sparse groups (``"sparse"``,
``"sparse_replica"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gem_model.parallel_dims import (
    DATA_DIMS,
    LOSS_DIMS,
    MESH_DIMS,
    SPARSE_GROUP,
    SPARSE_REPLICA_GROUP,
    ParallelDims,
)

if TYPE_CHECKING:
    from gem_model.distributed import DistEnv

__all__ = ["DATA_DIMS", "LOSS_DIMS", "MESH_DIMS", "Layout"]

FSDP_SHARD_DIMS = ("dp_shard", "cp")
"""The dims FSDP2 shards the dense part over (a cp rank holds other rows of the same samples)."""


@dataclass(frozen=True)
class Layout:
    """How the ranks of a run are arranged, and where this rank sits.

    ``dims``: the resolved degrees; ``rank``: this rank's global rank; ``mesh_dims``: the dims of the
    mesh, outermost first (default: :meth:`ParallelDims.mesh_dims`); ``groups``: the process group of
    each mesh dim and of each flattened combination or sparse group the planner made, None where no
    process group exists (one process, or a layout made offline by ``gem-train plan``); a mesh dim of
    degree 1 keeps its one-rank group. ``mesh``: a ``torch.distributed.DeviceMesh`` where one was built.
    """

    dims: ParallelDims
    rank: int = 0
    mesh_dims: tuple[str, ...] = ()
    groups: dict[str, Any] = field(default_factory=dict, compare=False)
    mesh: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if not self.dims.resolved:
            raise ValueError(f"layout: the degrees {self.dims} are not resolved (ParallelDims.resolve)")
        if not 0 <= self.rank < self.dims.world_size:
            raise ValueError(f"layout: rank {self.rank} is not in [0, {self.dims.world_size})")
        mesh_dims = self.mesh_dims or self.dims.mesh_dims()
        unknown = [d for d in mesh_dims if d not in MESH_DIMS]
        if unknown:
            raise ValueError(f"layout: unknown dim(s) {unknown}; allowed: {', '.join(MESH_DIMS)}")
        if list(mesh_dims) != [d for d in self.dims.mesh_order if d in mesh_dims]:
            raise ValueError(f"layout: mesh dims {list(mesh_dims)} are not in the mesh order {list(self.dims.mesh_order)}")
        left_out = [d for d in self.dims.enabled_dims if d not in mesh_dims]
        if left_out:
            raise ValueError(f"layout: dim(s) {left_out} have degree above 1 but are not mesh dims {list(mesh_dims)}")
        object.__setattr__(self, "mesh_dims", tuple(mesh_dims))

    # ------------------------------------------------------------------------------ construction

    @classmethod
    def data_parallel(cls, *, rank: int, world_size: int, group: Any = None, mesh: Any = None) -> Layout:
        """Every rank a data-parallel replica with every table (DDP, or one process): one mesh dim
        ``dp_replicate``."""
        dims = ParallelDims(dp_replicate=world_size, dp_shard=1, sparse=1)
        return cls(dims, rank, ("dp_replicate",), {"dp_replicate": group}, mesh)

    @classmethod
    def build(cls, dims: ParallelDims, env: DistEnv, *, mesh_dims: tuple[str, ...] = ()) -> Layout:
        """The layout of ``dims`` for this rank: with a ``DeviceMesh`` over ``mesh_dims`` (default:
        :meth:`ParallelDims.mesh_dims`), its flattened groups and the sparse groups when ``env`` has a
        process group; degrees and coordinates only when it has none (``gem-train plan``, checks)."""
        import torch.distributed as dist

        from gem_model.mesh import build_groups

        layout = cls(dims, env.rank, mesh_dims)
        if not (env.distributed and dist.is_available() and dist.is_initialized()):
            return layout
        mesh, groups = build_groups(layout, env.device.type, timeout_s=env.timeout_s)
        return cls(dims, env.rank, layout.mesh_dims, groups, mesh)

    # ----------------------------------------------------------------------------------- queries

    @property
    def degrees(self) -> dict[str, int]:
        """The mesh dims and their degrees, outermost first (what a plan stores)."""
        return {d: self.dims.degree(d) for d in self.mesh_dims}

    @property
    def coords(self) -> dict[str, int]:
        """This rank's index along each mesh dim."""
        at = self.dims.coordinates(self.rank)
        return {d: at[d] for d in self.mesh_dims}

    @property
    def world_size(self) -> int:
        return self.dims.world_size

    def degree(self, dim: str) -> int:
        if dim not in MESH_DIMS:
            raise ValueError(f"layout: unknown dim {dim!r}; allowed: {', '.join(MESH_DIMS)}")
        return self.dims.degree(dim)

    def enabled(self, dim: str) -> bool:
        return self.degree(dim) > 1

    def flat_name(self, *dims: str) -> str:
        """The key of the flattened group over ``dims``: those of degree above 1, in mesh order, joined by ``+``."""
        return "+".join(d for d in self.mesh_dims if d in dims and self.degree(d) > 1)

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas: which share of the batch it reads."""
        rank, at = 0, self.dims.coordinates(self.rank)
        for dim in (d for d in self.dims.mesh_order if d in DATA_DIMS):
            rank = rank * self.dims.degree(dim) + at[dim]
        return rank

    @property
    def dp_degree(self) -> int:
        """How many shares the global batch is split into (ranks of one tp/cp group read the same)."""
        return self.dims.dp_degree

    @property
    def loss_degree(self) -> int:
        """How many ranks' partial loss sums make up the global loss: data x context ranks."""
        return self.dims.loss_degree

    def group(self, *dims: str) -> Any:
        """The process group over ``dims`` (degree-1 dims ignored). When every one of ``dims`` spans
        this rank alone: the one-rank group the planner stored for one of them (a mesh dim of degree
        1 has one: torchrec's sharders and collectives need a real group even over one rank), else
        None (the dims are not in the mesh, or no process group exists). A flattened group must
        have been made by the planner."""
        for dim in dims:
            self.degree(dim)  # rejects an unknown name
        if all(g is None for g in self.groups.values()):
            return None  # no process group at all (one process, or a layout made offline)
        key = self.flat_name(*dims)
        if not key:
            return next((self.groups[d] for d in self.mesh_dims if d in dims and self.groups.get(d) is not None), None)
        if key not in self.groups:
            raise KeyError(f"layout: no process group over {key!r}; the planner made groups for {sorted(self.groups)}")
        return self.groups[key]

    @property
    def loss_group(self) -> Any:
        """The group the loss and the step's sums reduce over (a one-rank group or None: this rank
        alone, and the step reduces nothing)."""
        return self.group(*LOSS_DIMS)

    @property
    def sparse_group(self) -> Any:
        """The group the tables are sharded over: this rank's sparse group (the default group when
        it is every rank; None without a process group)."""
        if self.dims.sparse == self.world_size:
            import torch.distributed as dist

            return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        return self.groups.get(SPARSE_GROUP)

    @property
    def sparse_replica_group(self) -> Any:
        """The ranks (one per sparse group) that hold the same table shards as this one; None with
        one sparse group."""
        return self.groups.get(SPARSE_REPLICA_GROUP)

    def describe(self) -> dict[str, Any]:
        """Plain data: the mesh dims and degrees (what a plan stores; no groups, no coordinates)."""
        return {"degrees": dict(self.degrees), "world_size": self.world_size}

    def __str__(self) -> str:
        dims = " x ".join(f"{d}={n}" for d, n in self.degrees.items())
        return f"{dims} ({self.world_size} rank{'s' if self.world_size != 1 else ''})"
