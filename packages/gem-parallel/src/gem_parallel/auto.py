"""``auto``: the topology-aware planner of real runs. It chooses the degrees and the mesh order for
the world size and the cluster given, and ``fsdp`` applies them (on one GPU, ``torchrec_ddp``: the
same layout, torchrec's DMP with its fused table update, 5 % faster on the H200 than FSDP2 with
nothing to shard, ``benchmarks/results/plan_check.md``).

For the run it is bound to (:meth:`AutoPlanner.bind_run`: the model's sizes on the meta device, the
data's lengths, the batch), :func:`gem_parallel.topology_planner.plan_topology` searches every layout
``fsdp`` can apply (``dp_replicate``, ``dp_shard``, ``cp``, ``tp``, ``sparse``, the mesh order, the
cut of the sparse groups) on a cluster of ``world_size / gpus_per_node`` nodes with the stated links,
drops those that do not fit in memory, and keeps the one with the least communication per step, or,
with a ``profile`` (a one-GPU ``gem-train profile`` of the same run), the shortest predicted step
(:mod:`gem_parallel.step_model`). The tables are always sharded by torchrec, within sparse groups.

Every rank (and the check before launch) searches alike from the same inputs, so they agree on the
degrees without a collective. ``gem-train plan -c CONFIG --world-size N`` prints the choice, the
predicted step and the scaling efficiency.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from pydantic import Field

from gem_model.api import (
    ComponentConfig,
    ConfigError,
    DistEnv,
    Layout,
    ParallelDims,
    ParallelPlanner,
    Plan,
    PlannerContext,
    PreparedModel,
    RunShape,
    ShardableModel,
)
from gem_parallel.fsdp import FSDPConfig, FSDPPlanner
from gem_parallel.sharded import TorchrecDDPConfig, TorchrecDDPPlanner
from gem_parallel.sparse_plan import PlanDoesNotFitError
from gem_parallel.step_model import StepModel
from gem_parallel.topology import Topology
from gem_parallel.topology_planner import PlannerOptions, ShardingType, TopologyPlan, plan_topology
from gem_parallel.workload import workload_of

_WHERE = "parallel.planner.options"
GB = 1e9


class AutoConfig(ComponentConfig):
    gpus_per_node: int = Field(
        0, ge=0, description="GPUs (processes) per node; 0: those of the launch (--nproc, torchrun's LOCAL_WORLD_SIZE)"
    )
    intra_node_gbps: float = Field(450.0, gt=0, description="NVLink GB/s per GPU, one direction (H200: 450)")
    inter_node_gbps: float = Field(50.0, gt=0, description="network GB/s per GPU, one direction (a 400 Gb/s NIC: 50)")
    intra_node_latency_us: float = Field(3.0, ge=0, description="microseconds per message inside a node")
    inter_node_latency_us: float = Field(10.0, ge=0, description="microseconds per message between nodes")
    hbm_gb: float = Field(141.0, gt=0, description="memory per GPU in GB (H200: 141)")
    hbm_reserved_fraction: float = Field(0.1, ge=0, lt=1, description="kept free of the plan (allocator, NCCL, CUDA context)")
    profile: str | None = Field(
        None,
        description="a one-GPU gem-train profile of this run (its folder or profile.json): the layout with the "
        "shortest predicted step is chosen, and gem-train plan prints the prediction; none: the least communication",
    )
    max_tp: int | None = Field(None, ge=1, description="largest tp degree; none: the GPUs per node")
    max_cp: int = Field(16, ge=1, description="largest cp degree")
    fixed: dict[str, int] = Field(default_factory=dict, description="degrees to keep as given, e.g. {tp: 1}")
    sharding_types: list[ShardingType] = Field(
        default_factory=lambda: ["table_wise", "row_wise", "table_row_wise"],
        description="the sharding types torchrec's planner may give the tables",
    )
    reshard_after_forward: bool = Field(True, description="FSDP2: free the gathered parameters after forward")


class AutoPlanner(ParallelPlanner):
    name: ClassVar[str] = "auto"
    needs_process_group: ClassVar[bool] = True  # both appliers do (fsdp's mesh, torchrec's sharding), also of one
    Config = AutoConfig
    config: AutoConfig

    def __init__(self, config: AutoConfig | None = None):
        super().__init__(config)
        self._run: RunShape | None = None
        self._chosen: dict[int, TopologyPlan] = {}

    def bind_run(self, run: RunShape) -> None:
        same = self._run is not None and (run.config, run.ranks_per_node) == (self._run.config, self._run.ranks_per_node)
        if not same:  # another run: choose again (the check before launch and the plan bind the same one twice)
            self._chosen = {}
        self._run = run

    # ---------------------------------------------------------------------------- the choice

    def topology(self, world_size: int) -> Topology:
        c = self.config
        launched = self._run.ranks_per_node if self._run else None
        per_node = c.gpus_per_node or launched or (1 if world_size == 1 else 0)
        if not per_node:
            raise ConfigError([(f"{_WHERE}.gpus_per_node", 0, "nobody said how many GPUs a node has: set it (or launch with --nproc)")])
        per_node = min(per_node, world_size)
        if world_size % per_node:
            raise ConfigError([(f"{_WHERE}.gpus_per_node", per_node, f"must divide the world size {world_size} (whole nodes)")])
        return Topology(
            nodes=world_size // per_node, gpus_per_node=per_node, intra_node_bw=c.intra_node_gbps * GB,
            intra_node_latency=c.intra_node_latency_us * 1e-6, inter_node_bw=c.inter_node_gbps * GB,
            inter_node_latency=c.inter_node_latency_us * 1e-6, hbm_bytes=int(c.hbm_gb * GB),
            hbm_reserved_fraction=c.hbm_reserved_fraction,
        )  # fmt: skip

    def choose(self, world_size: int) -> TopologyPlan:
        """The search's result for ``world_size`` ranks (made once per world size)."""
        if world_size in self._chosen:
            return self._chosen[world_size]
        if self._run is None:
            raise ValueError("parallel.planner 'auto' plans a run it was bound to (bind_run) before it chooses degrees")
        c = self.config
        unknown = sorted(set(c.fixed) - {"dp_replicate", "dp_shard", "cp", "tp", "sparse"})
        if unknown:
            raise ConfigError([(f"{_WHERE}.fixed", c.fixed, f"unknown dim(s) {unknown}; allowed: dp_replicate, dp_shard, cp, tp, sparse")])
        config = self._run.config
        step_model = StepModel.from_profile(c.profile, config, where=f"{_WHERE}.profile") if c.profile else None
        dtype = self._run.activation_dtype
        workload = workload_of(self._run, activation_bytes=4 if dtype is None else dtype.itemsize)
        options = PlannerOptions(max_tp=c.max_tp, max_cp=c.max_cp, fixed=c.fixed, sharding_types=c.sharding_types)  # type: ignore[arg-type]
        try:
            chosen = plan_topology(self.topology(world_size), workload, options, step_model=step_model)
        except PlanDoesNotFitError as exc:
            raise ConfigError([("parallel.planner", self.name, f"found no layout of {world_size} GPUs: {exc}")]) from None
        self._chosen[world_size] = chosen
        return chosen

    def _applier(self, world_size: int) -> FSDPPlanner | TorchrecDDPPlanner:
        """What applies the choice: ``fsdp`` with the chosen degrees; on one rank ``torchrec_ddp``, whose
        layout is the same (every degree 1, the tables on the one rank)."""
        dims = self.choose(world_size).dims
        c = self.config
        if world_size == 1:
            return TorchrecDDPPlanner(TorchrecDDPConfig(sharding_types=list(c.sharding_types)))
        return FSDPPlanner(FSDPConfig(
            **dims.model_dump(), tables="sharded", sharding_types=list(c.sharding_types),
            reshard_after_forward=c.reshard_after_forward,
        ))  # fmt: skip

    # ------------------------------------------------- fsdp (torchrec_ddp on one rank) applies the choice

    def dims(self, world_size: int) -> ParallelDims:
        return self._applier(world_size).dims(world_size)

    def layout(self, env: DistEnv) -> Layout:
        return self._applier(env.world_size).layout(env)

    def plan(self, model: ShardableModel, ctx: PlannerContext) -> Plan:
        chosen = self.choose(ctx.layout.world_size)
        plan = self._applier(ctx.layout.world_size).plan(model, ctx)
        notes = [f"chosen for {chosen.topology.describe()} GPUs: {chosen.dims}, {chosen.dims.sparse_groups} sparse groups"]
        notes += choice_notes(chosen)
        return dataclasses.replace(plan, planner=self.name, notes=[*notes, *plan.notes], prediction=_prediction(chosen))

    def apply(self, model: ShardableModel, plan: Plan, ctx: PlannerContext) -> PreparedModel:
        return self._applier(ctx.layout.world_size).apply(model, plan, ctx)


def choice_notes(chosen: TopologyPlan) -> list[str]:
    """The prediction in words: the step, its parts, the throughput and the scaling efficiency."""
    comm = f"communication {1e3 * chosen.cost.comm_seconds:.2f} ms per step, all exposed"
    p = chosen.prediction
    if p is None:
        return [f"{comm}; no step-time prediction: set parallel.planner.options.profile to a one-GPU gem-train profile of this run"]
    return [
        f"predicted step {1e3 * p.step_seconds:.1f} ms: dense compute {1e3 * p.dense_compute:.1f} + embeddings "
        f"{1e3 * p.embeddings:.1f} + idle {1e3 * p.idle:.1f} + {comm}",
        f"predicted {p.tokens_per_s:,.0f} tokens/s; one GPU {1e3 * p.one_gpu_step_seconds:.1f} ms per step; scaling "
        f"efficiency {100 * p.scaling_efficiency:.1f} % (calibrated on {p.calibration})",
    ]


def _prediction(chosen: TopologyPlan) -> dict[str, object]:
    out: dict[str, object] = {
        "mesh_order": list(chosen.dims.mesh_order),
        "sparse_groups": chosen.dims.sparse_groups,
        "links": chosen.links(),
        "communication_seconds": chosen.cost.comm_seconds,
        "memory_per_rank_bytes": chosen.cost.memory.total,
    }
    if chosen.prediction is not None:
        out.update(chosen.prediction.to_dict())
    return out
