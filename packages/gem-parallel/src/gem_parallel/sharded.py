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

from typing import ClassVar, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DefaultDataParallelWrapper
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from gem_model.components import CommStrategy, ComponentConfig, ParallelPlanner, PreparedModel, SparseOptimizerSpec
from gem_model.distributed import DistEnv
from gem_model.model.gem import GemModel
from gem_parallel.state import copy_full_into_shards

ShardingTypeName = Literal["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]


class TorchrecDDPConfig(ComponentConfig):
    sharding_types: list[ShardingTypeName] = Field(
        default_factory=lambda: ["table_wise", "row_wise", "column_wise"],
        description="sharding types the planner may choose from, for every table",
    )
    bucket_cap_mb: int = Field(25, gt=0, description="DDP gradient bucket size")
    static_graph: bool = Field(False, description="DDP static_graph (every parameter used every step)")


class _CommAwareDDP(DefaultDataParallelWrapper):
    """torchrec's default DDP wrapper, then the communication strategy configures the DDP module."""

    def __init__(self, comm: CommStrategy, cfg: TorchrecDDPConfig):
        super().__init__(bucket_cap_mb=cfg.bucket_cap_mb, static_graph=cfg.static_graph)
        self.comm = comm

    def wrap(self, dmp: DistributedModelParallel, env: ShardingEnv, device: torch.device) -> None:
        super().wrap(dmp, env, device)
        wrapped = dmp._dmp_wrapped_module
        if isinstance(wrapped, nn.parallel.DistributedDataParallel):
            self.comm.configure_ddp(wrapped)


class TorchrecDDPPlanner(ParallelPlanner):
    name: ClassVar[str] = "torchrec_ddp"
    Config = TorchrecDDPConfig
    config: TorchrecDDPConfig

    def prepare(
        self, model: GemModel, *, env: DistEnv, comm: CommStrategy, sparse_optimizer: SparseOptimizerSpec
    ) -> PreparedModel:
        if not env.distributed:
            raise ValueError(
                "parallel.planner 'torchrec_ddp' needs a process group: launch with torchrun "
                "(or gem-train run --nproc N), or use parallel.planner=single"
            )
        if env.device.type == "cpu" and not sparse_optimizer.fused_on_cpu:
            raise ValueError(
                f"trainer.sparse_optimizer {sparse_optimizer.name!r}: FBGEMM's fused table update has no CPU kernel, "
                "so parallel.planner 'torchrec_ddp' cannot use it on the CPU; use rowwise_adagrad there or run on CUDA"
            )
        pg = dist.GroupMember.WORLD
        assert pg is not None
        # Tables built on the meta device (model.table_init: device) are drawn by torchrec on each
        # rank's device, uniformly within the configs' weight_init bounds; others are copied from the host.
        on_meta = model.sparse.on_meta
        full = {} if on_meta else {f"sparse.{k}": v.detach().clone() for k, v in model.sparse.state_dict().items()}
        fused_cls, fused_kwargs = sparse_optimizer.fused()
        apply_optimizer_in_backward(fused_cls, list(model.sparse.parameters()), fused_kwargs)
        codecs = get_qcomm_codecs_registry(comm.embedding_qcomms()) if comm.embedding_qcomms() else None
        sharders = [
            EmbeddingBagCollectionSharder(qcomm_codecs_registry=codecs),
            EmbeddingCollectionSharder(qcomm_codecs_registry=codecs),
        ]
        constraints = {
            name: ParameterConstraints(sharding_types=list(self.config.sharding_types), compute_kernels=["fused"])
            for name in _table_names(model)
        }
        hbm = torch.cuda.get_device_properties(env.device).total_memory if env.device.type == "cuda" else None
        planner = EmbeddingShardingPlanner(  # the device's real HBM, not torchrec's 32 GB default
            topology=Topology(world_size=env.world_size, compute_device=env.device.type, hbm_cap=hbm),
            constraints=constraints,
        )
        plan = planner.collective_plan(model, sharders, pg)
        model.sparse.grad_scale = 1.0 if get_gradient_division() else 1.0 / env.world_size
        dmp = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(pg),
            device=env.device,
            plan=plan,
            sharders=sharders,
            data_parallel_wrapper=_CommAwareDDP(comm, self.config),
        )
        copied = 0 if on_meta else copy_full_into_shards(dmp, full)
        where = "drawn on the device" if on_meta else f"{copied} copied from the host"
        dense = list(in_backward_optimizer_filter(dmp.named_parameters()))
        return PreparedModel(
            module=dmp,
            dense_parameters=dense,
            sparse_optimizer=dmp.fused_optimizer,
            sparse_optimizer_fused=True,
            plan_summary=f"tables sharded over {env.world_size} ranks ({where})\n{plan}",
        )


def _table_names(model: GemModel) -> list[str]:
    names = [cfg.name for cfg in model.sparse.ec.embedding_configs()]
    if model.sparse.ebc is not None:
        names += [cfg.name for cfg in model.sparse.ebc.embedding_bag_configs()]
    return names
