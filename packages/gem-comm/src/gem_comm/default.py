"""``default``: plain torch.distributed collectives.

DDP keeps its own all-reduce (gradient mean, fp32), the embedding all-to-all runs in full
precision, and metric reductions are one ``all_reduce`` over the group asked for (the trainer asks for
the layout's loss group; no group: the default one). In a single-process
run every reduction is the identity.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gem_model.api import CommStrategy, DistEnv


class DefaultComm(CommStrategy):
    name: ClassVar[str] = "default"

    def setup(self, env: DistEnv) -> None:
        super().setup(env)
        self._active = env.distributed and dist.is_initialized()

    def configure_ddp(self, ddp: DistributedDataParallel) -> None:
        """Nothing to change: DDP's built-in fp32 all-reduce averages the gradients."""

    def all_reduce_sum(self, values: torch.Tensor, group: Any = None) -> torch.Tensor:
        if not getattr(self, "_active", False):
            return values
        out = values.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    def all_reduce_mean(self, values: torch.Tensor, group: Any = None) -> torch.Tensor:
        if not getattr(self, "_active", False):
            return values
        return self.all_reduce_sum(values, group) / dist.get_world_size(group)
