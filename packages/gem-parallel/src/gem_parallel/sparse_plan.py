"""torchrec's sharding plan for one sparse group, made on the CPU without a process group.

The tables are built on the meta device (no memory, so a trillion parameters cost nothing), and
``EmbeddingShardingPlanner.plan`` is given a torchrec ``Topology`` of the sparse group: its world
size, how many of its ranks share a node, the memory left for tables on each rank and the
NVLink / network bandwidths. Every group holds the same plan (torchrec's 2-D sparse parallelism
replicates it across groups), so the planner sees ``sparse`` ranks, never the whole world.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints
from torchrec.distributed.planner import Topology as TorchrecTopology
from torchrec.distributed.planner.proposers import GreedyProposer
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.types import ShardingPlan

from gem_parallel.workload import Workload

MS = 1e3  # torchrec's bandwidths are in bytes per millisecond


class PlanDoesNotFitError(ValueError):
    """The model needs more memory than the devices have."""


@dataclass(frozen=True)
class SparseGroupPlan:
    plan: ShardingPlan
    topology: TorchrecTopology
    table_bytes_per_rank: tuple[float, ...]
    """Weights and optimizer state of the shards each rank of the group holds."""
    sharding_types: dict[str, str]
    table_ranks: dict[str, tuple[int, ...]]
    """Ranks of the group (0 .. sparse - 1) that hold a shard of each table."""

    @property
    def max_table_bytes(self) -> float:
        return max(self.table_bytes_per_rank)


def sparse_topology(*, world_size: int, local_world_size: int, hbm_for_tables: float, intra_bw: float,
                    inter_bw: float) -> TorchrecTopology:
    """torchrec's ``Topology`` of one sparse group (keywords that torchrec 1.6 to 1.8 all take)."""
    logging.getLogger("torchrec.distributed.planner.types").setLevel(logging.ERROR)
    return TorchrecTopology(
        world_size=world_size,
        local_world_size=local_world_size,
        compute_device="cuda",
        hbm_cap=int(hbm_for_tables),
        intra_host_bw=intra_bw / MS,
        inter_host_bw=inter_bw / MS,
    )


def meta_tables(w: Workload) -> nn.Module:
    """The workload's tables as torchrec modules on the meta device (one feature per table)."""
    meta = torch.device("meta")
    pooled = [EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=[t.name])
              for t in w.tables if t.kind == "pooled"]
    seq = [EmbeddingConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows, feature_names=[t.name])
           for t in w.tables if t.kind == "sequence"]
    mods: dict[str, nn.Module] = {}
    if pooled:
        mods["ebc"] = EmbeddingBagCollection(tables=pooled, device=meta)
    if seq:
        mods["ec"] = EmbeddingCollection(tables=seq, device=meta)
    return nn.ModuleDict(mods)


def plan_sparse_group(
    w: Workload,
    topology: TorchrecTopology,
    *,
    batch_size: int,
    sharding_types: list[str],
) -> SparseGroupPlan:
    """Shard every table of ``w`` over one sparse group; raise if a table is left out."""
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=list(sharding_types), compute_kernels=["fused"], pooling_factors=[w.ids_per_sample(t)]
        )
        for t in w.tables
    }
    planner = EmbeddingShardingPlanner(
        topology=topology,
        batch_size=batch_size,
        constraints=constraints,
        proposer=[GreedyProposer()],  # one proposer: the plan of a few hundred ranks in seconds
        # the caller's budget already leaves room for the dense part and activations
        storage_reservation=FixedPercentageStorageReservation(percentage=0.0),
        debug=False,
    )
    sharders = [EmbeddingBagCollectionSharder(), EmbeddingCollectionSharder()]
    try:
        plan = planner.plan(meta_tables(w), sharders)  # type: ignore[arg-type]
    except PlannerError as exc:
        largest = max(w.tables, key=w.table_storage_bytes)
        need = w.total_table_bytes
        have = topology.world_size * (topology.devices[0].storage.hbm if topology.devices else 0)
        raise PlanDoesNotFitError(
            f"torchrec could not place the tables on a sparse group of {topology.world_size} ranks: tables need "
            f"{need / 1e9:.1f} GB, the group has {have / 1e9:.1f} GB for them (shortfall "
            f"{max(need - have, 0) / 1e9:.1f} GB before torchrec's own reservations); largest table "
            f"{largest.name!r} ({w.table_storage_bytes(largest) / 1e9:.1f} GB). torchrec said: {str(exc)[:400]}"
        ) from exc
    return SparseGroupPlan(plan, topology, *_check_and_count(w, plan, topology.world_size))


def _check_and_count(
    w: Workload, plan: ShardingPlan, world: int
) -> tuple[tuple[float, ...], dict[str, str], dict[str, tuple[int, ...]]]:
    """Per-rank bytes of the plan; raise unless every table is placed whole (every row, every column)."""
    per_rank = [0.0] * world
    covered: dict[str, int] = defaultdict(int)
    types: dict[str, str] = {}
    ranks: dict[str, set[int]] = defaultdict(set)
    specs = {t.name: t for t in w.tables}
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():  # type: ignore[attr-defined]
            if name not in specs:
                raise ValueError(f"torchrec planned a table {name!r} that the workload does not have")
            types[name] = ps.sharding_type
            for shard in ps.sharding_spec.shards:  # type: ignore[union-attr]
                rows, cols = shard.shard_sizes
                covered[name] += rows * cols
                rank = shard.placement.rank()  # type: ignore[union-attr]
                ranks[name].add(rank)
                # a column shard keeps its own row-wise optimizer state for its rows
                per_rank[rank] += rows * cols * w.table_bytes + rows * w.table_optimizer_bytes_per_row
    missing = [t.name for t in w.tables if covered.get(t.name, 0) != t.params]
    if missing:
        detail = ", ".join(f"{n} ({covered.get(n, 0)} of {specs[n].params} elements)" for n in missing)
        raise ValueError(f"torchrec's plan does not place every table whole: {detail}")
    return tuple(per_rank), types, {n: tuple(sorted(r)) for n, r in ranks.items()}
