"""``overlap``: dense gradient buckets all-reduced while backward still runs.

DDP already launches a bucket's all-reduce as soon as its last gradient is ready, so backward and
communication overlap by construction; what decides how much hides is the bucketing. This
strategy owns it: :meth:`OverlapComm.ddp_kwargs` gives the planner ``bucket_cap_mb`` (smaller
buckets start sooner, larger ones cost fewer launches) and ``gradient_as_bucket_view`` (gradients
live in the buckets: no copy into them, less memory), and :meth:`OverlapComm.configure_ddp`
checks that the DDP module it gets was built with them (a planner that ignored them is an error,
not a silent default). The all-reduce itself is torch's ``allreduce_hook`` (divide by the world
size, sum in float32: DDP's own arithmetic, so the parameters equal ``default``'s bit for bit),
asynchronous, with its bytes counted.

Not here: the embedding all-to-all of batch ``i+1`` behind the dense compute of batch ``i`` is the
``sparse_dist`` train pipeline (:mod:`gem_comm.sparse_dist`, torchrec's ``TrainPipelineSparseDist``
split into the core's staged step), which composes with every strategy. FSDP2 (the ``fsdp``
planner) overlaps its own collectives by prefetching, with no hook.
"""

# no ``from __future__ import annotations``: DDP checks a comm hook's annotations as objects
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from pydantic import Field
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gem_comm._base import MeasuredComm
from gem_comm.measure import CommMeter, ring_all_reduce_bytes
from gem_model.api import ComponentConfig


class OverlapConfig(ComponentConfig):
    bucket_cap_mb: float = Field(25.0, gt=0, description="DDP gradient bucket size (replaces the planner's)")
    gradient_as_bucket_view: bool = Field(True, description="gradients are views into DDP's buckets (no copy)")


class _HookState:
    def __init__(self, group: dist.ProcessGroup, meter: CommMeter):
        self.group, self.meter = group, meter


def counted_allreduce_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    world = dist.get_world_size(state.group)
    state.meter.record("dense.all_reduce", ring_all_reduce_bytes(buffer.numel() * buffer.element_size(), world))
    return default_hooks.allreduce_hook(state.group, bucket)


class OverlapComm(MeasuredComm):
    name: ClassVar[str] = "overlap"
    Config = OverlapConfig
    config: OverlapConfig

    def ddp_kwargs(self) -> dict[str, Any]:
        return {"bucket_cap_mb": self.config.bucket_cap_mb, "gradient_as_bucket_view": self.config.gradient_as_bucket_view}

    def configure_ddp(self, ddp: DistributedDataParallel) -> None:
        group = self._ddp_group(ddp)
        want = int(self.config.bucket_cap_mb * 1024 * 1024)
        got = (ddp.bucket_bytes_cap, ddp.gradient_as_bucket_view)
        if got != (want, self.config.gradient_as_bucket_view):
            raise ValueError(
                f"comm.strategy 'overlap': the DDP module was built with bucket_bytes_cap={got[0]}, "
                f"gradient_as_bucket_view={got[1]}, not the strategy's bucket_cap_mb={self.config.bucket_cap_mb} "
                f"({want} bytes), gradient_as_bucket_view={self.config.gradient_as_bucket_view}: the planner must "
                "pass CommStrategy.ddp_kwargs() to DistributedDataParallel"
            )
        ddp.register_comm_hook(_HookState(group, self.meter), counted_allreduce_hook)
