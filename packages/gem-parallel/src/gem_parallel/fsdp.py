"""``fsdp``: the dense part in FSDP2 (HSDP with ``dp_replicate``), TP or CP in the HSTU blocks, the
tables replicated or sharded by torchrec.

The degrees are the core's :class:`~gem_model.parallel_dims.ParallelDims` (``FSDPConfig`` embeds its
fields), checked before any process starts; the layout is a named ``DeviceMesh`` over
``dp_replicate x dp_shard x cp x tp`` in their mesh order (:mod:`gem_model.mesh`).
:meth:`FSDPPlanner.apply` composes, in this order (TorchTitan's):

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
   groups of that many ranks (contiguous or strided), the replicas averaged across the groups after every step
   (:mod:`gem_parallel.sparse_groups`: torchrec's 2-D sparse parallelism).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.model_parallel import DataParallelWrapper
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.keyed import KeyedOptimizerWrapper

from gem_model.api import (
    DATA_DIMS,
    ComponentConfig,
    ConfigError,
    DensePlacement,
    DistEnv,
    Layout,
    ParallelDims,
    ParallelPlanner,
    Plan,
    PlannerContext,
    PrecisionPolicy,
    PreparedModel,
    RunShape,
    ShardableModel,
    TablePlacement,
    dims_of,
)
from gem_parallel.context_parallel import apply_context_parallel
from gem_parallel.sharded import (
    ShardingTypeName,
    TableOutputDtype,
    plan_tables,
    shard_tables,
    table_output_dtype_field,
    table_output_problems,
)
from gem_parallel.single import dense_modules, table_parameters
from gem_parallel.sparse_groups import ReplicaSync, plan_for_group
from gem_parallel.tensor_parallel import apply_tensor_parallel, check_tensor_parallel

_WHERE = "parallel.planner.options"
_INSIDE_BLOCKS = {"tp": "tensor_parallel", "cp": "context_parallel"}


class FSDPConfig(ParallelDims, ComponentConfig):
    """The degrees (:class:`~gem_model.parallel_dims.ParallelDims`'s fields: ``dp_replicate``,
    ``dp_shard``, ``cp``, ``tp``, ``sparse``, ``mesh_order``, ``sparse_groups``) and how FSDP2 and
    torchrec apply them."""

    reshard_after_forward: bool = Field(True, description="FSDP2: free the gathered parameters after forward")
    tables: Literal["replicated", "sharded"] = Field(
        "replicated",
        description="replicated: every rank holds every table, gradients averaged over the data ranks; sharded: "
        "torchrec's planner shards them over the ranks of each sparse group (DMP, the fused table optimizer), as "
        "torchrec_ddp does over all ranks",
    )
    sharding_types: list[ShardingTypeName] = Field(
        default_factory=lambda: ["table_wise", "row_wise", "column_wise"],
        description="with tables: sharded, the sharding types torchrec's planner may choose from",
    )
    table_output_dtype: TableOutputDtype = table_output_dtype_field()


def hsdp_order(dims: ParallelDims) -> bool:
    """Whether FSDP2 can shard in this mesh order: ``dp_replicate`` outside ``dp_shard`` (kept in the
    mesh at degree 1 beside it) and outside ``cp`` when there is one (HSDP's 2-D mesh is
    ``dp_replicate x (dp_shard x cp)``)."""
    order = dims.mesh_order
    inner = ("dp_shard", "cp") if dims.cp > 1 else ("dp_shard",)
    return all(order.index("dp_replicate") < order.index(d) for d in inner)


def fsdp_problems(config: FSDPConfig, where: str = _WHERE) -> list[tuple[str, object, str]]:
    """What ``fsdp``'s apply cannot do with these options, whatever the world size."""
    out: list[tuple[str, object, str]] = []
    if config.table_output_dtype != "float32" and config.tables != "sharded":
        out.append((f"{where}.table_output_dtype", config.table_output_dtype,
                    "is the output dtype of torchrec's sharded lookups: it needs tables: sharded"))  # fmt: skip
    if config.tp > 1 and config.cp > 1:
        out.append((f"{where}.tp", config.tp, f"tp = {config.tp} and cp = {config.cp} together are not supported yet; use one of them"))
    order = list(config.mesh_order)
    if not hsdp_order(dims_of(config)):
        out.append((
            f"{where}.mesh_order", order,
            "dp_replicate must come before dp_shard and cp (HSDP: FSDP2 replicates over the outer dim of its 2-D mesh)",
        ))  # fmt: skip
    if config.tables == "replicated" and config.sparse:
        out.append((f"{where}.sparse", config.sparse, f"shards the tables within groups of ranks; it needs {where}.tables = sharded"))
    return out


class FSDPPlanner(ParallelPlanner):
    name: ClassVar[str] = "fsdp"
    needs_process_group: ClassVar[bool] = True  # FSDP2 and the device mesh need a process group, also of one
    Config = FSDPConfig
    config: FSDPConfig

    _device: str | None = None  # the run's trainer.device, once bound (bind_run)

    def bind_run(self, run: RunShape) -> None:
        self._device = run.config.trainer.device

    def dims(self, world_size: int) -> ParallelDims:
        problems = fsdp_problems(self.config) + table_output_problems(self.config.table_output_dtype, self._device)
        request = dims_of(self.config)
        if self.config.tables == "replicated":
            request = request.model_copy(update={"sparse": 1})  # every rank holds every table
        try:
            dims = request.resolve(world_size, where=_WHERE)
        except ConfigError as exc:
            problems += exc.problems
        if problems:
            raise ConfigError(problems)
        return dims

    def layout(self, env: DistEnv) -> Layout:
        dims = self.dims(env.world_size)
        # FSDP2 replicates only over the first dim of a 2-D mesh: dp_shard stays beside dp_replicate
        keep = ("dp_shard",) if dims.dp_replicate > 1 or not dims.enabled_dims else ()
        return Layout.build(dims, env, mesh_dims=dims.mesh_dims(keep))

    def plan(self, model: ShardableModel, ctx: PlannerContext) -> Plan:
        layout, dims = ctx.layout, ctx.layout.dims
        if dims.tp > 1:
            check_tensor_parallel(model, dims.tp, where=f"{_WHERE}.tp")
        data = [d for d in layout.mesh_dims if d in DATA_DIMS and layout.enabled(d)]
        native = None
        if self.config.tables == "sharded":
            # every sparse group gets the same plan, for a topology of its own size (rank 0 plans)
            native, tables = plan_tables(
                self.name, model, env=ctx.env, world_size=dims.sparse, group=_world(ctx.env), comm=ctx.comm,
                sparse_optimizer=ctx.sparse_optimizer, sharding_types=self.config.sharding_types,
                table_output=self.config.table_output_dtype,
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

    def apply(self, model: ShardableModel, plan: Plan, ctx: PlannerContext) -> PreparedModel:
        env, layout, dims = ctx.env, ctx.layout, ctx.layout.dims
        if layout.mesh is None:
            raise ValueError(
                f"parallel.planner {self.name!r} needs a process group and its device mesh: launch with torchrun "
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
                raise ValueError(f"parallel.planner {self.name!r} with tables: sharded applies only a plan it made in this process")
            group_size = dims.sparse
            native = plan_for_group(plan.native, ranks=dims.sparse_group_ranks(layout.rank))
            dmp, where = shard_tables(
                model, native, env=env, group=layout.sparse_group or _world(env), degree=group_size,
                comm=ctx.comm, sparse_optimizer=ctx.sparse_optimizer, data_parallel_wrapper=_NoDenseWrapper(),
                table_output=self.config.table_output_dtype,
            )  # fmt: skip
            outer, sparse, tables_note = dmp, dmp.fused_optimizer, f"tables sharded over {group_size} ranks ({where})"
            if group_size < layout.world_size:
                after_step = ReplicaSync.of(dmp, layout.sparse_replica_group)
                tables_note += f" in each of {layout.world_size // group_size} sparse groups, averaged across them"
        tables = table_parameters(model)
        if dp_mesh is not None:
            root = MixedPrecisionPolicy(**{**policy, "output_dtype": None})  # the loss sums stay float32
            fully_shard(module, mp_policy=root, ignored_params=set(tables.values()), **kw)
        if not sharded:
            spec = ctx.sparse_optimizer
            outer, tables_note = module, f"{len(tables)} table tensors replicated"
            sparse = _DataParallelTables(tables, lambda ps: spec.cls(ps, **spec.kwargs), group=layout.group(*DATA_DIMS))
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


def fsdp_mesh(layout: Layout) -> DeviceMesh | None:
    """The mesh FSDP2 shards the dense part over: ``dp_shard x cp`` (flattened; a cp rank holds other
    rows of the same samples, so its gradients average with the data shards'), 2-D with
    ``dp_replicate`` in front for HSDP; None when the layout has no data or context dim."""
    shard = layout.flat_name("dp_shard", "cp") or ("dp_shard" if "dp_shard" in layout.mesh_dims else "")
    if not shard:
        return layout.mesh["dp_replicate"] if "dp_replicate" in layout.mesh_dims else None
    return layout.mesh[("dp_replicate", shard)] if "dp_replicate" in layout.mesh_dims else layout.mesh[shard]


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
