"""``fsdp``: the dense part in FSDP2 (HSDP with ``dp_replicate``), TP or CP in the HSTU blocks, the
tables replicated or sharded by torchrec.

The layout is a named ``DeviceMesh`` over ``dp_replicate x dp_shard x cp x tp``
(:mod:`gem_parallel.mesh`). :meth:`FSDPPlanner.apply` composes, in this order (TorchTitan's):

1. ``tp > 1``: tensor parallelism in every HSTU block with DTensor ``parallelize_module``
   (:mod:`gem_parallel.tensor_parallel`); ``cp > 1``: each sequence's rows split over the cp ranks
   inside the blocks (:mod:`gem_parallel.context_parallel`);
2. FSDP2 ``fully_shard`` on every HSTU block, then on the model for the remaining dense
   parameters, over ``dp_shard x cp`` (1-D), or ``dp_replicate x (dp_shard x cp)`` (2-D: HSDP,
   sharded within a replica group, all-reduced across them); the run's precision policy maps onto
   ``MixedPrecisionPolicy`` (:meth:`gem_model.precision.PrecisionPolicy.fsdp_mixed_precision`:
   float32 masters all-gathered, float32 gradient reduction, block outputs in the activation dtype;
   the model's own output, the loss sums, stays float32);
3. the embedding tables are left out of FSDP (``ignored_params``). ``tables: replicated``: every
   rank holds them and their optimizer averages their gradients over the data-parallel ranks (one
   coalesced all-reduce) before it steps, as DDP would. ``tables: sharded``: torchrec's planner
   and DMP shard them over all ranks, as ``torchrec_ddp`` does, with a data-parallel wrapper that
   wraps nothing (FSDP2 owns the dense part); with ``sparse`` below the world size, within sparse
   groups of that many ranks, the replicas averaged across the groups after every step
   (:mod:`gem_parallel.sparse_groups`: torchrec's 2-D sparse parallelism).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.keyed import KeyedOptimizerWrapper

from gem_model.components import CommStrategy, ComponentConfig, ParallelPlanner, PreparedModel, SparseOptimizerSpec
from gem_model.distributed import DistEnv
from gem_model.layout import DATA_DIMS, Layout
from gem_model.plan import DensePlacement, Plan, TablePlacement
from gem_model.precision import PrecisionPolicy
from gem_model.protocols import ShardableModel
from gem_parallel.context_parallel import apply_context_parallel
from gem_parallel.dims import ParallelDims
from gem_parallel.mesh import build_layout, fsdp_mesh
from gem_parallel.sharded import ShardingTypeName, plan_tables, shard_tables
from gem_parallel.single import dense_modules, table_parameters
from gem_parallel.sparse_groups import REPLICA_GROUP, SHARDING_GROUP, ReplicaSync, make_sparse_groups, plan_for_group
from gem_parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel

_WHERE = "parallel.planner.options"
_INSIDE_BLOCKS = {"tp": "tensor_parallel", "cp": "context_parallel"}


class FSDPConfig(ComponentConfig):
    dp_replicate: int = Field(1, ge=1, description="HSDP replica groups (gradients all-reduced across them)")
    dp_shard: int = Field(0, ge=0, description="FSDP2 shards of the dense part; 0: the world size / (dp_replicate x tp x cp)")
    tp: int = Field(1, ge=1, description="tensor-parallel ranks in the HSTU blocks (must divide model.num_heads)")
    cp: int = Field(1, ge=1, description="context-parallel ranks: each sequence's rows split over them (head-tail)")
    reshard_after_forward: bool = Field(True, description="FSDP2: free the gathered parameters after forward")
    tables: Literal["replicated", "sharded"] = Field(
        "replicated",
        description="replicated: every rank holds every table, gradients averaged over the data ranks; sharded: "
        "torchrec's planner shards them over all ranks (DMP, the fused table optimizer), as torchrec_ddp does",
    )
    sparse: int = Field(
        0,
        ge=0,
        description="with tables: sharded, the ranks of one sparse group (0: all ranks); the tables are sharded "
        "within each group and replicated across the world / sparse groups, averaged after every step",
    )
    sharding_types: list[ShardingTypeName] = Field(
        default_factory=lambda: ["table_wise", "row_wise", "column_wise"],
        description="with tables: sharded, the sharding types torchrec's planner may choose from",
    )


class FSDPPlanner(ParallelPlanner):
    name: ClassVar[str] = "fsdp"
    needs_process_group: ClassVar[bool] = True  # FSDP2 and the device mesh need a process group, also of one
    Config = FSDPConfig
    config: FSDPConfig

    def dims(self, world_size: int) -> ParallelDims:
        """The degrees for ``world_size`` ranks; a ValueError names the option that does not fit."""
        c = self.config
        if c.tp > 1 and c.cp > 1:
            raise ValueError(f"{_WHERE}: tp = {c.tp} and cp = {c.cp} together are not supported yet; use one of them")
        rest, left = divmod(world_size, c.dp_replicate * c.tp * c.cp)
        if left:
            raise ValueError(
                f"{_WHERE}.dp_replicate x tp x cp = {c.dp_replicate} x {c.tp} x {c.cp} does not divide the world size {world_size}"
            )
        dp_shard = c.dp_shard or rest
        if c.dp_replicate * dp_shard * c.tp * c.cp != world_size:
            raise ValueError(
                f"{_WHERE}.dp_replicate x dp_shard x tp x cp = {c.dp_replicate} x {dp_shard} x {c.tp} x {c.cp} = "
                f"{c.dp_replicate * dp_shard * c.tp * c.cp}, but the world size is {world_size}"
            )
        if c.tables == "replicated":
            if c.sparse:
                raise ValueError(
                    f"{_WHERE}.sparse = {c.sparse} shards the tables within groups of ranks; it needs {_WHERE}.tables = sharded"
                )
            sparse = 1  # every rank holds every table: sparse groups of one rank
        else:
            sparse = c.sparse or world_size
            if world_size % sparse:
                raise ValueError(f"{_WHERE}.sparse = {c.sparse} must divide the world size {world_size} (groups of sparse ranks)")
        return ParallelDims(dp_replicate=c.dp_replicate, dp_shard=dp_shard, tp=c.tp, cp=c.cp, sparse=sparse)

    def layout(self, env: DistEnv) -> Layout:
        dims = self.dims(env.world_size)
        layout = build_layout(dims, env)
        if self.config.tables == "replicated" or dims.sparse == env.world_size or layout.mesh is None:
            return layout
        groups = make_sparse_groups(world_size=env.world_size, sparse=dims.sparse, device_type=env.device.type)
        return Layout(layout.degrees, layout.coords, {**layout.groups, **groups}, layout.mesh)

    def plan(
        self, model: ShardableModel, *, env: DistEnv, layout: Layout, comm: CommStrategy, sparse_optimizer: SparseOptimizerSpec
    ) -> Plan:
        dims = self.dims(layout.world_size)
        if dims.tp > 1:
            check_tensor_parallel(model, dims.tp, where=f"{_WHERE}.tp")
        data = [d for d in DATA_DIMS if layout.enabled(d)]
        native = None
        if self.config.tables == "sharded":
            # every sparse group gets the same plan, for a topology of its own size (rank 0 plans)
            native, tables = plan_tables(
                self.name, model, env=env, world_size=dims.sparse, group=_world(env), comm=comm,
                sparse_optimizer=sparse_optimizer, sharding_types=self.config.sharding_types,
            )  # fmt: skip
            notes = [
                f"tables sharded by torchrec over all {layout.world_size} ranks" if dims.sparse == layout.world_size
                else f"tables sharded by torchrec within each of {dims.sparse_replicas} sparse groups of {dims.sparse} "
                "ranks (table ranks are ranks within a group), replicas averaged across the groups after every step"
            ]  # fmt: skip
        else:
            ranks = list(range(layout.world_size))
            tables = {
                c.name: TablePlacement("replicated", ranks, rows=c.num_embeddings, dim=c.embedding_dim)
                for c in model.table_configs()
            }
            notes = [f"tables replicated on every rank, gradients averaged over {'+'.join(data) or 'one rank'}"]
        blocks = {fqn.split(".")[0] for fqn in model.activation_blocks()}
        sharded = [*data, *(["cp"] if dims.cp > 1 else [])]
        dense = {}
        for name, n in dense_modules(model).items():
            inner = [d for d in ("tp", "cp") if dims.degree(d) > 1] if name in blocks else []
            strategy = "+".join([*(_INSIDE_BLOCKS[d] for d in inner), "fully_sharded"])
            dense[name] = DensePlacement(strategy, [*sharded, *(["tp"] if "tp" in inner else [])], n)
        return Plan(self.name, layout.describe(), tables, dense, notes, native=native)

    def apply(
        self,
        model: ShardableModel,
        plan: Plan,
        *,
        env: DistEnv,
        layout: Layout,
        comm: CommStrategy,
        sparse_optimizer: SparseOptimizerSpec,
    ) -> PreparedModel:
        if layout.mesh is None:
            raise ValueError(
                "parallel.planner 'fsdp' needs a process group and its device mesh: launch with torchrun "
                "(or gem-train run --nproc N), or use parallel.planner=single"
            )
        if model.tables_on_meta:  # model.table_init: device
            model.materialize_tables(env.device)
        module: torch.nn.Module = model.to(env.device)  # type: ignore[attr-defined]
        # no broadcast of rank 0's weights: the core builds every rank's model from rank 0's stream
        if layout.enabled("tp"):  # 1: TP first, so FSDP shards the TP shards
            apply_tensor_parallel(model, layout.mesh["tp"])
        if layout.enabled("cp"):
            apply_context_parallel([module.get_submodule(f) for f in model.activation_blocks()], layout.group("cp"))
        dp_mesh = fsdp_mesh(layout)
        policy = PrecisionPolicy(model.activation_dtype, scheme="").fsdp_mixed_precision()
        kw: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": self.config.reshard_after_forward}
        if dp_mesh is not None:  # 2: FSDP2 / HSDP over the data (and context) dims
            for fqn in model.activation_blocks():
                fully_shard(module.get_submodule(fqn), mp_policy=MixedPrecisionPolicy(**policy), **kw)
        sharded = self.config.tables == "sharded"
        after_step = None
        if sharded:  # 3: torchrec's DMP over all ranks or a sparse group, before FSDP2 wraps the model
            if plan.native is None:
                raise ValueError("parallel.planner 'fsdp' with tables: sharded applies only a plan it made in this process")
            group_size = self.dims(layout.world_size).sparse
            native = plan_for_group(plan.native, first_rank=layout.rank // group_size * group_size)
            dmp, where = shard_tables(
                model, native, env=env, group=layout.groups.get(SHARDING_GROUP, _world(env)), degree=group_size,
                comm=comm, sparse_optimizer=sparse_optimizer, data_parallel_wrapper=_NoDenseWrapper(),
            )  # fmt: skip
            outer, sparse, tables_note = dmp, dmp.fused_optimizer, f"tables sharded over {group_size} ranks ({where})"
            if group_size < layout.world_size:
                after_step = ReplicaSync.of(dmp, layout.groups[REPLICA_GROUP])
                tables_note += f" in each of {layout.world_size // group_size} sparse groups, averaged across them"
        tables = table_parameters(model)
        if dp_mesh is not None:
            root = MixedPrecisionPolicy(**{**policy, "output_dtype": None})  # the loss sums stay float32
            fully_shard(module, mp_policy=root, ignored_params=set(tables.values()), **kw)
        if not sharded:
            outer, tables_note = module, f"{len(tables)} table tensors replicated"
            sparse = _DataParallelTables(
                tables, lambda ps: sparse_optimizer.cls(ps, **sparse_optimizer.kwargs), group=layout.group(*DATA_DIMS)
            )
        names = dp_mesh.mesh_dim_names if dp_mesh is not None else ()
        how = f"HSDP over {' x '.join(names)}" if len(names) > 1 else f"FSDP2 over {names[0]}" if names else "no FSDP"
        inside = [what for dim, what in (("tp", "TP"), ("cp", "CP")) if layout.enabled(dim)]
        return PreparedModel(
            module=outer,
            dense_parameters=model.dense_named_parameters(),
            sparse_optimizer=sparse,
            sparse_optimizer_fused=sharded,
            after_optimizer_step=after_step,
            plan_summary=f"dense part over {layout}: {how}"
            + (f", {'+'.join(inside)} in the HSTU blocks" if inside else "")
            + f"; {tables_note}",
        )


def _world(env: DistEnv) -> Any:
    return dist.group.WORLD if env.distributed else None


class _NoDenseWrapper(DataParallelWrapper):
    """torchrec's DMP wraps the dense part in DDP by default; here FSDP2 owns it."""

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        pass


class _DataParallelTables(KeyedOptimizerWrapper):
    """The tables' optimizer of a replicated sparse part: before each step, the tables' gradients
    are averaged over the data-parallel ranks in one all-reduce (a table a rank's batch did not
    touch counts as a zero gradient), so every replica takes the same step."""

    def __init__(self, params: dict[str, torch.nn.Parameter], factory: Any, *, group: Any):
        super().__init__(params, factory)
        self._tables, self._group = list(params.values()), group

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        if self._group is not None and dist.get_world_size(self._group) > 1:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self._tables]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self._group)
            flat /= dist.get_world_size(self._group)
            for p, g in zip(self._tables, flat.split([g.numel() for g in grads]), strict=True):
                p.grad = g.view_as(p)
        super().step(closure)
