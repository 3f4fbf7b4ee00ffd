"""The topology-aware planner: degrees and mesh order for a cluster, then torchrec's plan of the tables.

1. Every assignment of degrees whose mesh product is the world size, that the model allows and that
   ``fsdp`` can apply (the checks of :meth:`ParallelDims.problems
   <gem_model.parallel_dims.ParallelDims.problems>`: ``tp`` divides the heads, ``2 * cp`` is at most
   the longest sequence, the data-parallel degree divides the batch, ``sparse`` divides the world;
   besides, ``tp`` stays within a node, ``tp`` and ``cp`` are not both above 1, and a sparse group
   can hold the tables).
2. For each, every order of its enabled mesh dims (innermost on NVLink) that ``fsdp`` can apply
   (``dp_replicate`` outside ``dp_shard`` and ``cp``: HSDP) and both ways of cutting the sparse
   groups (contiguous or strided ranks), costed by :mod:`gem_parallel.cost`, and with a calibration
   (:mod:`gem_parallel.step_model`) the whole step predicted; layouts that do not fit in memory are
   dropped.
3. The cheapest is kept; torchrec's ``EmbeddingShardingPlanner`` then shards the tables over one
   sparse group, and the step is costed again with the per-rank table bytes torchrec chose.

Plain data out (:class:`TopologyPlan`): the ``auto`` planner (:mod:`gem_parallel.auto`) hands its
degrees to ``fsdp``'s apply. Nothing here needs a process group or a GPU.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gem_model.api import MESH_DIMS, ParallelDims
from gem_parallel.cost import GB, Lookups, StepCost, dense_part, estimate, sparse_part
from gem_parallel.fsdp import hsdp_order
from gem_parallel.sparse_plan import PlanDoesNotFitError, SparseGroupPlan, plan_sparse_group, sparse_topology
from gem_parallel.step_model import Prediction, StepModel
from gem_parallel.topology import DIM_NAMES, Topology, place
from gem_parallel.workload import Workload

NAIVE_ORDER = {"mesh_order": ("cp", "tp", "dp_shard", "dp_replicate"), "sparse_groups": "strided"}
"""What a planner that ignores the network lays out: the dimensions in the order they are declared,
the first innermost, and torchrec's default strided sparse groups."""

ShardingType = Literal["table_wise", "row_wise", "column_wise", "table_row_wise"]
"""torchrec sharding types a table may take (``data_parallel`` is left out: a table is sharded)."""


class PlannerOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tp: int | None = Field(None, ge=1, description="largest tp degree; None: the GPUs per node")
    max_cp: int = Field(16, ge=1, description="largest cp degree")
    fixed: dict[Literal["dp_replicate", "dp_shard", "cp", "tp", "sparse"], int] = Field(
        default_factory=dict, description="degrees to keep as given"
    )
    sharding_types: list[ShardingType] = Field(
        default_factory=lambda: ["table_wise", "row_wise", "table_row_wise"],
        description="torchrec sharding types the tables may take",
    )


@dataclass(frozen=True)
class TopologyPlan:
    topology: Topology
    workload: Workload
    cost: StepCost
    naive: StepCost
    """The same degrees in :data:`NAIVE_ORDER`."""
    sparse: SparseGroupPlan
    candidates: int
    """Layouts costed (degrees x orders)."""
    seconds: float
    """Planning time, torchrec's planner included."""
    torchrec_seconds: float
    """The part of it spent in torchrec's ``EmbeddingShardingPlanner``."""
    prediction: Prediction | None = None
    """The whole step of the chosen layout, with a calibration (:class:`~gem_parallel.step_model.StepModel`)."""

    @property
    def dims(self) -> ParallelDims:
        return self.cost.dims

    def mesh_degrees(self) -> dict[str, int]:
        """The mesh, outermost first (every mesh dim, degree 1 included)."""
        return {n: self.dims.degree(n) for n in self.dims.mesh_order}

    def links(self) -> dict[str, str]:
        return {n: self.cost.placements[n].link for n in DIM_NAMES}

    def to_dict(self) -> dict[str, Any]:
        def step(c: StepCost) -> dict[str, Any]:
            return {
                "order": list(c.dims.mesh_order),
                "sparse_groups": c.dims.sparse_groups,
                "comm_seconds": c.comm_seconds,
                "per_dim": [vars(d) for d in c.per_dim],
            }

        return {
            "topology": self.topology.model_dump(),
            "dims": self.dims.model_dump(mode="json"),
            "mesh": self.mesh_degrees(),
            "sparse_groups": self.dims.sparse_groups,
            "links": self.links(),
            "chosen": step(self.cost),
            "naive": step(self.naive),
            "memory_per_rank": self.cost.memory.items() | {"total": self.cost.memory.total},
            "usable_hbm": self.topology.usable_hbm,
            "sparse_group": {
                "world_size": self.sparse.topology.world_size,
                "local_world_size": self.sparse.topology.local_world_size,
                "sharding_types": self.sparse.sharding_types,
                "table_bytes_per_rank_max": self.sparse.max_table_bytes,
                "table_bytes_per_rank_min": min(self.sparse.table_bytes_per_rank),
            },
            "prediction": None if self.prediction is None else self.prediction.to_dict(),
            "candidates": self.candidates,
            "planning_seconds": self.seconds,
            "torchrec_seconds": self.torchrec_seconds,
        }

    def summary(self) -> str:
        lines = [
            f"{self.topology.describe()} GPUs: {self.dims}, mesh outer->inner "
            f"{list(self.dims.mesh_order)}, {self.dims.sparse_groups} sparse groups",
            f"{'dim':<16}{'degree':>7} {'link':<8}{'MB/step':>12}{'ms/step':>10}  (naive order: link, ms)",
        ]
        naive = {c.dim: c for c in self.naive.per_dim}
        for c in self.cost.per_dim:
            n = naive[c.dim]
            lines.append(
                f"{c.dim:<16}{c.degree:>7} {c.link:<8}{c.bytes_per_step / 1e6:>12.1f}{c.seconds * 1e3:>10.2f}"
                f"  ({n.link}, {n.seconds * 1e3:.2f})"
            )
        lines.append(f"comm per step {self.cost.comm_seconds * 1e3:.2f} ms (naive order {self.naive.comm_seconds * 1e3:.2f} ms)")
        mem = ", ".join(f"{k} {v / GB:.1f}" for k, v in self.cost.memory.items().items())
        lines.append(f"memory per rank {self.cost.memory.total / GB:.1f} GB of {self.topology.usable_hbm / GB:.1f} ({mem})")
        return "\n".join(lines)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _dense_candidates(topo: Topology, w: Workload, opts: PlannerOptions) -> Iterator[ParallelDims]:
    """Degrees of the mesh dims (``sparse`` left at 1) that the model, the cluster and ``fsdp`` allow."""
    world = topo.world_size
    max_tp = opts.max_tp or topo.gpus_per_node
    fixed = opts.fixed

    def keep(name: str, degree: int) -> bool:
        return fixed.get(name, degree) == degree  # type: ignore[call-overload]

    for tp in divisors(world):
        if tp > max_tp or w.num_heads % tp or not keep("tp", tp):
            continue
        for cp in divisors(world // tp):
            if cp > opts.max_cp or (cp > 1 and (2 * cp > w.lengths.max or tp > 1)) or not keep("cp", cp):
                continue
            rest = world // tp // cp
            for dp_shard in divisors(rest):
                dp_replicate = rest // dp_shard
                if not (keep("dp_shard", dp_shard) and keep("dp_replicate", dp_replicate)):
                    continue
                if w.global_batch_size % (dp_replicate * dp_shard):
                    continue
                yield ParallelDims(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, cp=cp, sparse=1)


def _sparse_candidates(topo: Topology, w: Workload, opts: PlannerOptions) -> list[int]:
    """Sparse group sizes that divide the world and can hold the tables."""
    return [
        s for s in divisors(topo.world_size)
        if w.total_table_bytes / s <= topo.usable_hbm and opts.fixed.get("sparse", s) == s
    ]


def candidate_dims(topo: Topology, w: Workload, opts: PlannerOptions) -> Iterator[ParallelDims]:
    """Every degree assignment the model and the cluster allow, before memory is checked."""
    sparse_options = _sparse_candidates(topo, w, opts)
    for dense in _dense_candidates(topo, w, opts):
        for s in sparse_options:
            yield dense.model_copy(update={"sparse": s})


def _cuts(sparse: int, world: int) -> tuple[str, ...]:
    return ("contiguous", "strided") if 1 < sparse < world else ("contiguous",)


def orders(dims: ParallelDims) -> Iterator[ParallelDims]:
    """``dims`` in every mesh order of their enabled dims that ``fsdp`` applies (HSDP's replicas
    outside its shards: :func:`~gem_parallel.fsdp.hsdp_order`; of the dims of degree 1,
    ``dp_replicate`` outermost and the others innermost) and, when the tables have more than one
    group, both ways of cutting the sparse groups."""
    enabled = tuple(n for n in MESH_DIMS if dims.degree(n) > 1)
    first = ("dp_replicate",) if "dp_replicate" not in enabled else ()
    last = tuple(n for n in MESH_DIMS if n not in enabled and n != "dp_replicate")
    for perm in itertools.permutations(enabled):
        ordered = dims.model_copy(update={"mesh_order": first + perm + last})
        if not hsdp_order(ordered):
            continue
        for cut in _cuts(dims.sparse, dims.world_size):
            yield ordered.model_copy(update={"sparse_groups": cut})


def plan_topology(
    topology: Topology, workload: Workload, options: PlannerOptions | None = None, *, step_model: StepModel | None = None
) -> TopologyPlan:
    """The cheapest layout of ``workload`` on ``topology``, with torchrec's plan of its tables.

    Cheapest: the least exposed communication per step, or with ``step_model`` (a calibration on a
    measured profile) the shortest predicted step. Raises
    :class:`~gem_parallel.sparse_plan.PlanDoesNotFitError` naming the largest item and the shortfall
    when no layout fits in memory.
    """
    opts = options or PlannerOptions()
    start = time.perf_counter()
    best, leanest, count = _search(topology, workload, opts, step_model)
    if best is None:
        raise _does_not_fit(topology, workload, estimate(leanest, topology, workload) if leanest else None)
    chosen = estimate(best, topology, workload)
    sparse_pl = chosen.placements["sparse"]
    tables_budget = topology.usable_hbm - (chosen.memory.total - chosen.memory.tables)
    # torchrec counts the weights of meta tables, not the row-wise optimizer state beside them
    weights = sum(t.params for t in workload.tables) * workload.table_bytes
    tables_budget *= weights / workload.total_table_bytes
    sparse_topo = sparse_topology(
        world_size=chosen.dims.sparse,
        local_world_size=sparse_pl.members_per_node,
        hbm_for_tables=tables_budget,
        intra_bw=topology.intra_node_bw,
        inter_bw=topology.inter_node_bw,
    )
    samples = max(1, workload.global_batch_size // chosen.dims.dp_degree)
    searched = time.perf_counter()
    sparse = plan_sparse_group(workload, sparse_topo, batch_size=samples, sharding_types=list(opts.sharding_types))
    torchrec_seconds = time.perf_counter() - searched
    tables = sparse.max_table_bytes
    final = estimate(chosen.dims, topology, workload, table_bytes_per_rank=tables)
    naive = estimate(chosen.dims.model_copy(update=NAIVE_ORDER), topology, workload, table_bytes_per_rank=tables)
    if final.memory.total > topology.usable_hbm:
        raise PlanDoesNotFitError(
            f"torchrec's placement puts {tables / GB:.1f} GB of tables on the fullest rank of the sparse group of "
            f"{chosen.dims.sparse} ({workload.total_table_bytes / chosen.dims.sparse / GB:.1f} GB if even): "
            f"{final.memory.total / GB:.1f} GB per rank, a shortfall of "
            f"{(final.memory.total - topology.usable_hbm) / GB:.1f} GB ({chosen.dims}); allow row_wise "
            "in sharding_types or fix a larger sparse degree"
        )
    prediction = None if step_model is None else step_model.predict(final, workload)
    return TopologyPlan(topology, workload, final, naive, sparse, count, time.perf_counter() - start, torchrec_seconds,
                        prediction)  # fmt: skip


def _search(
    topo: Topology, w: Workload, opts: PlannerOptions, step_model: StepModel | None
) -> tuple[ParallelDims | None, ParallelDims | None, int]:
    """(cheapest layout that fits, leanest layout, layouts costed).

    The dense dims' costs depend on their order, the sparse group's only on its size, the cut, the
    data-parallel degree and ``cp``, the compute only on the degrees: each part is costed once and
    the sums compared.
    """
    lookups = Lookups.of(w)
    usable = topo.usable_hbm
    sparse_options = _sparse_candidates(topo, w, opts)
    sparse_cache: dict[tuple[int, str, int, int], tuple[float, float]] = {}
    best: tuple[float, ParallelDims] | None = None
    leanest: tuple[float, ParallelDims] | None = None
    count = 0
    for dense in _dense_candidates(topo, w, opts):
        compute = 0.0 if step_model is None else step_model.compute_seconds(dense, w)
        for dense_order in orders(dense):
            d_costs, d_mem = dense_part(dense_order, place(dense_order, topo), topo, w)
            d_seconds, d_bytes = sum(c.seconds for c in d_costs), sum(d_mem.values())
            for s in sparse_options:
                for cut in _cuts(s, topo.world_size):
                    dims = dense_order.model_copy(update={"sparse": s, "sparse_groups": cut})
                    key = (s, cut, dense.dp_degree, dense.cp)
                    if key not in sparse_cache:
                        s_costs, s_mem = sparse_part(dims, place(dims, topo), topo, w, lookups)
                        sparse_cache[key] = (sum(c.seconds for c in s_costs), sum(s_mem.values()))
                    s_seconds, s_bytes = sparse_cache[key]
                    count += 1
                    mem = d_bytes + s_bytes
                    if leanest is None or mem < leanest[0]:
                        leanest = (mem, dims)
                    seconds = compute + d_seconds + s_seconds
                    if mem <= usable and (best is None or seconds < best[0]):
                        best = (seconds, dims)
    return (best and best[1]), (leanest and leanest[1]), count


def _does_not_fit(topo: Topology, w: Workload, leanest: StepCost | None) -> PlanDoesNotFitError:
    largest = max(w.tables, key=w.table_storage_bytes)
    largest_table = f"table {largest.name!r} ({w.table_storage_bytes(largest) / GB:.1f} GB with its optimizer state)"
    usable = topo.usable_hbm
    if leanest is None:  # the tables alone exceed the whole cluster
        need = w.total_table_bytes / topo.world_size
        return PlanDoesNotFitError(
            f"the model does not fit on {topo.describe()} GPUs ({usable / GB:.1f} GB usable each): the tables alone "
            f"need {w.total_table_bytes / GB:.1f} GB, {need / GB:.1f} GB per GPU sharded over all "
            f"{topo.world_size}, a shortfall of {(need - usable) / GB:.1f} GB per GPU "
            f"({(w.total_table_bytes - usable * topo.world_size) / GB:.1f} GB in all); the largest item is {largest_table}"
        )
    items = leanest.memory.items()
    big = max(items, key=lambda k: items[k])
    short = leanest.memory.total - usable
    return PlanDoesNotFitError(
        f"the model does not fit on {topo.describe()} GPUs ({usable / GB:.1f} GB usable each): the leanest layout "
        f"({leanest.dims}) needs {leanest.memory.total / GB:.1f} GB per rank, a shortfall of "
        f"{short / GB:.1f} GB; its largest item is {big} ({items[big] / GB:.1f} GB); the largest table is {largest_table}"
    )


__all__ = [
    "NAIVE_ORDER",
    "PlanDoesNotFitError",
    "PlannerOptions",
    "SparseGroupPlan",
    "TopologyPlan",
    "candidate_dims",
    "orders",
    "plan_topology",
]
