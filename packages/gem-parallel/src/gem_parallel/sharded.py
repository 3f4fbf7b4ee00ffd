"""``torchrec_ddp``: embedding tables sharded by torchrec's planner, the dense part in DDP.

- The tables get torchrec's fused row-wise Adagrad (it steps inside backward), set up with
  ``apply_optimizer_in_backward`` before sharding, as torchrec expects.
- ``EmbeddingShardingPlanner`` chooses a sharding per table among the allowed types (data-parallel
  tables are excluded by default: a table is sharded, or the run says why not).
- The communication strategy provides the embedding all-to-all codecs (qcomms) and configures DDP.
- DDP averages dense gradients over ranks; torchrec's all-to-all backward divides table gradients
  by the world size too ("gradient division", on by default), so both are the mean. Where that
  division is switched off, the sparse arch scales its gradients by ``1 / world_size`` instead.
- Shards are filled from the unsharded model's weights, so every world size starts from the same
  tables (torchrec's fused modules would otherwise draw their own initial values).
"""

from __future__ import annotations

import warnings
from typing import Any, ClassVar, Literal

import torch
from fbgemm_gpu.split_embedding_configs import SparseType
from pydantic import Field
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DataParallelWrapper, DefaultDataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv, ShardingPlan
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from gem_model.api import (
    CommStrategy,
    ComponentConfig,
    ConfigError,
    DensePlacement,
    DistEnv,
    Layout,
    ParallelDims,
    ParallelPlanner,
    Plan,
    PlannerContext,
    PreparedModel,
    RunShape,
    ShardableModel,
    SparseOptimizerSpec,
    TablePlacement,
)
from gem_parallel import recat_cache
from gem_parallel.single import dense_modules
from gem_parallel.state import copy_full_into_shards

ShardingTypeName = Literal["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]
TableOutputDtype = Literal["float32", "bfloat16", "float16"]


def table_output_dtype_field() -> Any:
    """The option ``table_output_dtype`` of the planners that shard tables with torchrec."""
    return Field(
        "float32",
        description="the dtype the sharded tables' lookups come out in (FBGEMM's output_dtype): bfloat16 or float16 "
        "halve the bytes the lookups write, the embedding all-to-alls move and the table gradients carry back; the "
        "tables and their optimizer state stay float32. bfloat16 needs CUDA (FBGEMM's CPU sequence lookup has none)",
    )


class TorchrecDDPConfig(ComponentConfig):
    sharding_types: list[ShardingTypeName] = Field(
        default_factory=lambda: ["table_wise", "row_wise", "column_wise"],
        description="sharding types the planner may choose from, for every table",
    )
    bucket_cap_mb: int = Field(25, gt=0, description="DDP gradient bucket size")
    static_graph: bool = Field(False, description="DDP static_graph (every parameter used every step)")
    table_output_dtype: TableOutputDtype = table_output_dtype_field()
    cache_recat: bool | None = Field(
        None,
        description="make torchrec's input-distribution feature permutation once per shape instead of every "
        "forward, which removes its host sync (gem_parallel.recat_cache): None (default) where this torchrec's "
        "function is the one the cache was written for, else off (the run says why); true: on, an error where "
        "it cannot be; false: off",
    )


class _CommAwareDDP(DefaultDataParallelWrapper):
    """torchrec's default DDP wrapper, then the communication strategy configures the DDP module."""

    def __init__(self, comm: CommStrategy, cfg: TorchrecDDPConfig):
        # a strategy that owns the bucketing (gem-comm's ``overlap``) names it; its value wins
        ddp_kwargs = dict(comm.ddp_kwargs())
        bucket_cap_mb = ddp_kwargs.pop("bucket_cap_mb", cfg.bucket_cap_mb)
        if ddp_kwargs.pop("gradient_as_bucket_view", True) is not True:  # torchrec's wrapper fixes it
            raise ValueError(
                f"parallel.planner 'torchrec_ddp': comm.strategy {comm.name!r} asks for gradient_as_bucket_view=False, "
                "but torchrec's DDP wrapper always builds DDP with gradient_as_bucket_view=True"
            )
        super().__init__(bucket_cap_mb=bucket_cap_mb, static_graph=cfg.static_graph, **({"ddp_kwargs": ddp_kwargs} if ddp_kwargs else {}))
        self.comm = comm

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        super().wrap(dmp, env, device)
        wrapped = dmp._dmp_wrapped_module
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            self.comm.configure_ddp(wrapped)


class TorchrecDDPPlanner(ParallelPlanner):
    name: ClassVar[str] = "torchrec_ddp"
    needs_process_group: ClassVar[bool] = True  # torchrec shards its tables over a process group, also of one
    Config = TorchrecDDPConfig
    config: TorchrecDDPConfig

    _device: str | None = None  # the run's trainer.device, once bound (bind_run)

    def bind_run(self, run: RunShape) -> None:
        self._device = run.config.trainer.device

    def dims(self, world_size: int) -> ParallelDims:
        """Every rank a data-parallel replica of the dense part; the tables sharded over all ranks."""
        problems = table_output_problems(self.config.table_output_dtype, self._device)
        if problems:
            raise ConfigError(problems)
        return ParallelDims(dp_replicate=world_size, dp_shard=1, sparse=world_size)

    def layout(self, env: DistEnv) -> Layout:
        """One mesh dim ``dp_replicate`` (its group: the mesh's, also over one rank)."""
        return Layout.build(self.dims(env.world_size), env, mesh_dims=("dp_replicate",))

    def plan(self, model: ShardableModel, ctx: PlannerContext) -> Plan:
        layout = ctx.layout
        native, tables = plan_tables(
            self.name, model, env=ctx.env, world_size=layout.world_size, group=layout.group("dp_replicate"),
            comm=ctx.comm, sparse_optimizer=ctx.sparse_optimizer, sharding_types=self.config.sharding_types,
            table_output=self.config.table_output_dtype,
        )  # fmt: skip
        dense = {name: DensePlacement("replicated", ["dp_replicate"], n) for name, n in dense_modules(model).items()}
        return Plan(self.name, layout.describe(), tables, dense, native=native)

    def apply(self, model: ShardableModel, plan: Plan, ctx: PlannerContext) -> PreparedModel:
        env, layout = ctx.env, ctx.layout
        if not env.distributed:
            raise ValueError(
                "parallel.planner 'torchrec_ddp' needs a process group: launch with torchrun "
                "(or gem-train run --nproc N), or use parallel.planner=single"
            )
        if plan.native is None:
            raise ValueError("parallel.planner 'torchrec_ddp' applies only a plan it made in this process (plan.native)")
        dmp, where = shard_tables(
            model, plan.native, env=env, group=layout.group("dp_replicate"), degree=layout.dp_degree, comm=ctx.comm,
            sparse_optimizer=ctx.sparse_optimizer, data_parallel_wrapper=_CommAwareDDP(ctx.comm, self.config),
            table_output=self.config.table_output_dtype,
        )  # fmt: skip
        dense = list(in_backward_optimizer_filter(dmp.named_parameters()))
        _install_recat_cache(self.config.cache_recat)
        return PreparedModel(
            module=dmp,
            dense_parameters=dense,
            sparse_optimizer=dmp.fused_optimizer,
            sparse_optimizer_fused=True,
            plan_summary=f"tables sharded over {layout.world_size} ranks ({where})\n{plan.native}",
        )


def _install_recat_cache(wanted: bool | None) -> None:
    """The recat cache for the process, the run's forwards from here on (``cache_recat``: None where it
    fits this torchrec, with a warning where it does not; True, or an error; False, never)."""
    if wanted is False:
        return
    reason = recat_cache.incompatibility()
    if reason is not None and wanted is None:
        warnings.warn(f"{reason}: running without the recat cache (parallel.planner.options.cache_recat)", stacklevel=2)
        return
    recat_cache.install()  # raises where it cannot (wanted is True)


def plan_tables(
    planner: str,
    model: ShardableModel,
    *,
    env: DistEnv,
    world_size: int,
    group: Any,
    comm: CommStrategy,
    sparse_optimizer: SparseOptimizerSpec,
    sharding_types: list[str],
    table_output: TableOutputDtype = "float32",
) -> tuple[ShardingPlan, dict[str, TablePlacement]]:
    """torchrec's plan of every table over the ``world_size`` ranks of ``group`` (rank 0 plans, every
    rank gets its plan; without a process group, planned here), checked that no table is dropped."""
    if env.device.type == "cpu" and not sparse_optimizer.fused_on_cpu:
        raise ValueError(
            f"trainer.sparse_optimizer {sparse_optimizer.name!r}: FBGEMM's fused table update has no CPU kernel, "
            f"so parallel.planner {planner!r} cannot use it on the CPU; use rowwise_adagrad there or run on CUDA"
        )
    if env.device.type == "cpu" and table_output == "bfloat16":
        raise ConfigError(table_output_problems(table_output, "cpu"))
    if table_output != "float32" and comm.embedding_qcomms() is not None:
        raise ConfigError([("parallel.planner.options.table_output_dtype", table_output,
                            f"comm.strategy {comm.name!r} quantizes the embedding all-to-alls, whose codecs take float32 "
                            "lookups (FBGEMM's): keep float32 lookups with it, or a comm strategy without qcomms")])  # fmt: skip
    # torchrec's planner costs the fused optimizer's state, so the tables carry it before planning
    _fuse_table_optimizer(model, sparse_optimizer)
    constraints = {
        cfg.name: ParameterConstraints(sharding_types=list(sharding_types), compute_kernels=["fused"])
        for cfg in model.table_configs()
    }
    hbm = torch.cuda.get_device_properties(env.device).total_memory if env.device.type == "cuda" else None
    planner_ = EmbeddingShardingPlanner(  # the device's real HBM, not torchrec's 32 GB default
        topology=Topology(world_size=world_size, compute_device=env.device.type, hbm_cap=hbm),
        constraints=constraints,
    )
    sharders = _sharders(comm, table_output)
    if env.distributed:
        native = planner_.collective_plan(model, sharders, group)  # type: ignore[arg-type]
    else:
        native = planner_.plan(model, sharders)  # type: ignore[arg-type]
    sizes = {cfg.name: (cfg.num_embeddings, cfg.embedding_dim) for cfg in model.table_configs()}
    tables = {
        table: TablePlacement(ps.sharding_type, list(ps.ranks or []), ps.compute_kernel, rows=sizes[table][0], dim=sizes[table][1])
        for module_plan in native.plan.values()
        for table, ps in module_plan.items()  # type: ignore[attr-defined]
    }
    missing = sorted(set(sizes) - set(tables))
    if missing:
        raise ValueError(f"parallel.planner {planner!r}: torchrec's plan places no shard of table(s) {missing}")
    return native, tables


def shard_tables(
    model: ShardableModel,
    native: ShardingPlan,
    *,
    env: DistEnv,
    group: Any,
    degree: int,
    comm: CommStrategy,
    sparse_optimizer: SparseOptimizerSpec,
    data_parallel_wrapper: DataParallelWrapper,
    table_output: TableOutputDtype = "float32",
) -> tuple[DistributedModelParallel, str]:
    """torchrec's DMP over ``group`` with the fused table optimizer, the shards filled from the
    unsharded tables (or drawn on the device for meta tables); ``degree``: the data-parallel ranks
    whose table gradients are averaged. Returns the DMP and where its shards came from."""
    # Tables built on the meta device (model.table_init: device) are drawn by torchrec on each
    # rank's device, uniformly within the configs' weight_init bounds; others are copied from the host.
    on_meta = model.tables_on_meta
    full = {} if on_meta else {k: v.detach().clone() for k, v in model.table_state_dict().items()}
    _fuse_table_optimizer(model, sparse_optimizer)
    model.set_table_grad_scale(1.0 if get_gradient_division() else 1.0 / degree)
    dmp = DistributedModelParallel(
        model,  # type: ignore[arg-type]
        env=ShardingEnv.from_process_group(group),
        device=env.device,
        plan=native,
        sharders=_sharders(comm, table_output),
        data_parallel_wrapper=data_parallel_wrapper,
    )
    copied = 0 if on_meta else copy_full_into_shards(dmp, full)
    return dmp, "drawn on the device" if on_meta else f"{copied} copied from the host"


SPARSE_TYPES = {"float32": SparseType.FP32, "bfloat16": SparseType.BF16, "float16": SparseType.FP16}
"""FBGEMM's name of each ``table_output_dtype``."""


def table_output_problems(table_output: TableOutputDtype, device: str | None) -> list[tuple[str, object, str]]:
    """``table_output_dtype`` against the run's ``trainer.device`` (None: not known yet)."""
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if table_output == "bfloat16" and on_cpu:
        return [("parallel.planner.options.table_output_dtype", table_output,
                 "FBGEMM's CPU sequence lookup has no bfloat16 output: use float16 or float32 on the CPU")]  # fmt: skip
    return []


def _sharders(comm: CommStrategy, table_output: TableOutputDtype = "float32") -> list:
    """torchrec's sharders of both table kinds: the comm strategy's codecs for the all-to-alls, and the
    lookups' output dtype (``fused_params``, which torchrec hands FBGEMM's table kernels)."""
    codecs = get_qcomm_codecs_registry(comm.embedding_qcomms()) if comm.embedding_qcomms() else None
    fused = None if table_output == "float32" else {"output_dtype": SPARSE_TYPES[table_output]}
    return [
        EmbeddingBagCollectionSharder(fused_params=fused, qcomm_codecs_registry=codecs),
        EmbeddingCollectionSharder(fused_params=fused, qcomm_codecs_registry=codecs),
    ]


def _fuse_table_optimizer(model: ShardableModel, sparse_optimizer: SparseOptimizerSpec) -> None:
    """torchrec's ``apply_optimizer_in_backward`` on every table, once (plan and apply both need it)."""
    params = [p for module in model.table_modules().values() for p in module.parameters()]
    if all(hasattr(p, "_in_backward_optimizers") for p in params):
        return
    fused_cls, fused_kwargs = sparse_optimizer.fused()
    apply_optimizer_in_backward(fused_cls, params, fused_kwargs)
