"""torchrec's 2-D sparse parallelism on any backend: tables sharded within sparse groups, replicated across them.

``fsdp``'s option ``sparse`` cuts the world into ``world / sparse`` groups of ``sparse`` ranks,
consecutive ones (``sparse_groups: contiguous``: the replicas of a shard are ``sparse`` ranks
apart) or every ``world / sparse``-th (``strided``: the replicas are neighbours); the core's layout
makes the groups (:mod:`gem_model.mesh`). Every group gets the same torchrec plan, made for a
``Topology`` of ``sparse`` ranks, and its own ``DistributedModelParallel`` whose ``ShardingEnv`` is
the group's process group. After every optimizer step, the ranks that hold the same shard (one per group: the
replica group) average its weights and its optimizer state in one all-reduce.

That is what torchrec's ``DMPCollection(sharding_group_size=sparse, use_inter_host_allreduce=True)``
does with its ``sync()`` (``ShardingStrategy.DEFAULT``: weights and optimizer state averaged over
the replica group); ``DMPCollection`` itself runs only on CUDA (torchrec 1.6 to 1.8 assert it), so
this is the equivalent built on the same sub-groups: tested on gloo, the same code on NCCL. With
``trainer.sparse_optimizer: sgd`` (no state) the averaged weights are the one-process update
(up to the order of float sums); with a stateful optimizer (row-wise Adagrad's accumulator, Adam's moments) each replica
steps on its own group's gradient and the averaged state is DMPCollection's approximation.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen
from torch import nn
from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
from torch.distributed.remote_device import _remote_device
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.types import ShardingPlan


def plan_for_group(plan: ShardingPlan, *, ranks: list[int], local_size: int | None = None) -> ShardingPlan:
    """A copy of the sparse group's plan for the group of global ``ranks`` (in group order:
    :meth:`ParallelDims.sparse_group_ranks <gem_model.parallel_dims.ParallelDims.sparse_group_ranks>`).

    torchrec reads a parameter's ``ranks`` as ranks within the ``ShardingEnv``'s group (they stay),
    but the shards' placements as global ranks (ShardedTensor checks them against the group's
    global ranks): group rank ``i`` moves to ``ranks[i]``, as ``DMPCollection`` remaps its plan, and
    an accelerator placement names the global rank's device on its node (``local_size`` ranks a
    node; default: torchrun's ``LOCAL_WORLD_SIZE``)."""
    out = copy.deepcopy(plan)
    for module_plan in out.plan.values():
        for sharding in module_plan.values():  # type: ignore[attr-defined]
            spec = sharding.sharding_spec
            if not isinstance(spec, EnumerableShardingSpec):
                continue
            for shard in spec.shards:
                rank, device = ranks[shard.placement.rank()], shard.placement.device()  # type: ignore[union-attr]
                if device.type != "cpu":
                    device = torch.device(device.type, rank % (local_size or get_local_size()))
                shard.placement = _remote_device(f"rank:{rank}/{device}")
    return out


@dataclass
class ReplicaSync:
    """Averages every table shard this rank holds (weights and optimizer state) with its replicas
    in the other sparse groups: one in-place all-reduce per shard tensor over ``group``."""

    tensors: dict[torch.dtype, list[torch.Tensor]]
    group: dist.ProcessGroup

    @classmethod
    def of(cls, dmp: nn.Module, group: dist.ProcessGroup) -> ReplicaSync:
        """The shards of every FBGEMM table-batched kernel in ``dmp`` (views of its weights and of its
        optimizer's state, so averaging them in place updates the kernel)."""
        tensors: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
        kernels = list(dict.fromkeys(_kernels(dmp)))
        if not kernels:
            raise ValueError("parallel.planner 'fsdp': the sharded tables have no FBGEMM kernel to average across sparse groups")
        for kernel in kernels:
            for weight in kernel.split_embedding_weights():
                tensors[weight.dtype].append(weight)
            for states in kernel.split_optimizer_states():
                for state in states:
                    tensors[state.dtype].append(state)
        return cls(dict(tensors), group)

    @torch.no_grad()
    def __call__(self) -> None:
        replicas = dist.get_world_size(self.group)
        for tensors in self.tensors.values():
            for t in tensors:  # in place, one tensor at a time: a flat copy of every shard would double the tables' memory
                buf = t if t.is_contiguous() else t.contiguous()  # FBGEMM's views are contiguous slices
                dist.all_reduce(buf, group=self.group)  # gloo has no ReduceOp.AVG: sum, then divide
                buf /= replicas
                if buf is not t:
                    t.copy_(buf)


def _kernels(module: nn.Module) -> list[SplitTableBatchedEmbeddingBagsCodegen]:
    """The FBGEMM kernels under ``module``; a sharded torchrec module keeps its lookups in a plain
    list (``_lookups``), not as submodules, so they are walked too (as ``DMPCollection`` does)."""
    found = [module] if isinstance(module, SplitTableBatchedEmbeddingBagsCodegen) else []
    for child in [*module.children(), *getattr(module, "_lookups", [])]:
        found += _kernels(child)
    return found
