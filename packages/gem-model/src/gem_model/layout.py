"""The parallel layout of a run: named dimensions, their degrees, this rank's place, each dim's group.

Like TorchTitan's ``ParallelDims``. A planner makes the layout (:meth:`ParallelPlanner.layout
<gem_model.components.ParallelPlanner.layout>`) before the loader exists, and everything in the
loop that depends on how the ranks are arranged reads it here, never ``world_size``:

- the loader shards the global batch by :attr:`Layout.dp_rank` over :attr:`Layout.dp_degree`;
- the loss (and the step's metric sums) reduce over :attr:`Layout.loss_group`, the data x context
  ranks, and the loss is normalised by :attr:`Layout.loss_degree`;
- MFU is per GPU: the FLOPs of the global batch over :attr:`Layout.world_size` devices.

Dimension names are the TorchTitan ones, outermost first: ``pp`` (pipeline), ``dp_replicate``
and ``dp_shard`` (data: replicated, as DDP, and sharded, as FSDP), ``cp`` (context), ``tp``
(tensor). A dim that is absent has degree 1; the mesh may list them in another order (the
coordinates follow the mesh). ``ep`` (experts) may be added by a planner; it is neither a data nor
a context dim here. A planner may keep further groups that are no mesh dim in ``groups`` (e.g.
``"sparse"``: torchrec's sharding group of the tables, which divides the world rather than
multiplying it); they are read as ``layout.groups[name]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
DATA_DIMS = ("dp_replicate", "dp_shard")
LOSS_DIMS = (*DATA_DIMS, "cp")


@dataclass(frozen=True)
class Layout:
    """How the ``world_size`` ranks of a run are arranged, and where this rank sits.

    ``degrees`` lists every dim of the mesh in mesh order (outermost first); their product is the
    world size. ``coords`` gives this rank's index along each dim. ``groups`` holds the process
    group of each dim, and of each flattened combination a planner made (keyed ``"dp_replicate+cp"``
    and so on); a group is None where no process group exists (one process, or a plan made offline
    by ``gem-train plan``); a mesh dim of degree 1 keeps its one-rank group. ``mesh`` is a
    ``torch.distributed.DeviceMesh`` where the planner built one.
    """

    degrees: dict[str, int]
    coords: dict[str, int]
    groups: dict[str, Any] = field(default_factory=dict, compare=False)
    mesh: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        unknown = [d for d in self.degrees if d not in DIM_ORDER]
        if unknown:
            raise ValueError(f"layout: unknown dim(s) {unknown}; allowed: {', '.join(DIM_ORDER)}")
        for dim, degree in self.degrees.items():
            if degree < 1:
                raise ValueError(f"layout: dim {dim!r} has degree {degree}; degrees are at least 1")
            if not 0 <= self.coords.get(dim, -1) < degree:
                raise ValueError(f"layout: this rank's coordinate along {dim!r} is {self.coords.get(dim)}, not in [0, {degree})")
        extra = set(self.coords) - set(self.degrees)
        if extra:
            raise ValueError(f"layout: coordinates for dims not in the mesh: {sorted(extra)}")

    # ------------------------------------------------------------------------------ construction

    @classmethod
    def data_parallel(cls, *, rank: int, world_size: int, group: Any = None, mesh: Any = None) -> Layout:
        """Every rank a data-parallel replica (DDP, or one process): one dim ``dp_replicate``."""
        return cls({"dp_replicate": world_size}, {"dp_replicate": rank}, {"dp_replicate": group}, mesh)

    # ----------------------------------------------------------------------------------- queries

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees.values())

    @property
    def rank(self) -> int:
        """This rank's global rank, row-major over the dims in mesh order."""
        rank = 0
        for dim, degree in self.degrees.items():
            rank = rank * degree + self.coords[dim]
        return rank

    def degree(self, dim: str) -> int:
        if dim not in DIM_ORDER:
            raise ValueError(f"layout: unknown dim {dim!r}; allowed: {', '.join(DIM_ORDER)}")
        return self.degrees.get(dim, 1)

    def enabled(self, dim: str) -> bool:
        return self.degree(dim) > 1

    def _flat(self, dims: tuple[str, ...]) -> tuple[int, int]:
        """(rank, degree) of this rank along the flattened ``dims`` (row-major in mesh order)."""
        rank, degree = 0, 1
        for dim in (d for d in self.degrees if d in dims):
            rank, degree = rank * self.degrees[dim] + self.coords[dim], degree * self.degrees[dim]
        return rank, degree

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas: which share of the batch it reads."""
        return self._flat(DATA_DIMS)[0]

    @property
    def dp_degree(self) -> int:
        """How many shares the global batch is split into (ranks of one tp/cp/pp group read the same)."""
        return self._flat(DATA_DIMS)[1]

    @property
    def loss_degree(self) -> int:
        """How many ranks' partial loss sums make up the global loss: data x context ranks."""
        return self._flat(LOSS_DIMS)[1]

    def group(self, *dims: str) -> Any:
        """The process group over ``dims`` (degree-1 dims ignored). When every one of ``dims`` spans
        this rank alone: the one-rank group the planner stored for one of them (a mesh dim of degree
        1 has one: torchrec's sharders and collectives need a real group even over one rank), else
        None (the dims are not in the mesh, or no process group exists). A flattened group must
        have been made by the planner."""
        for dim in dims:
            self.degree(dim)  # rejects an unknown name
        live = tuple(d for d in self.degrees if d in dims and self.degrees[d] > 1)
        if not live:
            return next((self.groups[d] for d in self.degrees if d in dims and self.groups.get(d) is not None), None)
        key = "+".join(live)
        if key not in self.groups:
            raise KeyError(f"layout: no process group over {key!r}; the planner made groups for {sorted(self.groups)}")
        return self.groups[key]

    @property
    def loss_group(self) -> Any:
        """The group the loss and the step's sums reduce over (a one-rank group or None: this rank
        alone, and the step reduces nothing)."""
        return self.group(*LOSS_DIMS)

    def describe(self) -> dict[str, Any]:
        """Plain data: the dims and degrees (what a plan stores; no groups, no coordinates)."""
        return {"degrees": dict(self.degrees), "world_size": self.world_size}

    def __str__(self) -> str:
        dims = " x ".join(f"{d}={n}" for d, n in self.degrees.items())
        return f"{dims} ({self.world_size} rank{'s' if self.world_size != 1 else ''})"
