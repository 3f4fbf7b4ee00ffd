"""``sm_free``: NCCL collectives that take few or no SMs from the GEMMs.

NCCL only: the strategy makes its own NCCL process group over the DDP group's ranks, with
``ProcessGroupNCCL.Options`` chosen by what the loaded NCCL and this torch support, and
all-reduces the dense gradients over it (torch's ``allreduce_hook``). The path is recorded in
:attr:`SmFreeComm.path` and reported by :meth:`SmFreeComm.measurements` (``sm_free.path.<name>``: 1):

- ``cta_policy_zero``: NCCL >= 2.28 and an ``NCCLConfig`` with ``cta_policy``: the zero-CTA
  policy (``comm.strategy.options.cta_policy``, NCCL's ``NCCL_CTA_POLICY_ZERO``), with which NCCL
  runs eligible collectives on the copy engines through symmetric windows;
- ``cta_caps``: older NCCL: ``max_ctas`` / ``min_ctas`` / ``cga_cluster_size`` caps.

NVLink multicast stays off (``NCCL_NVLS_ENABLE=0`` is set before the group is made, unless the
environment already says otherwise: then it must say 0). ``torch.distributed._symmetric_memory``'s
low-contention all-gather / reduce-scatter are not wired in yet. On gloo (any CPU run) the strategy
is refused in :meth:`setup`, before training, naming the option. Nothing here has run on NCCL in
this repository's CI: it needs GPUs (see docs/comm.md).
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from pydantic import Field
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gem_comm._base import MeasuredComm
from gem_model.api import ComponentConfig, DistEnv


class SmFreeConfig(ComponentConfig):
    cta_policy: int = Field(2, ge=0, description="NCCL CTA policy for NCCL >= 2.28 (NCCL_CTA_POLICY_ZERO)")
    max_ctas: int = Field(4, gt=0, description="older NCCL: most CTAs (SMs) a collective may take")
    min_ctas: int = Field(1, gt=0, description="older NCCL: fewest CTAs")
    cga_cluster_size: int = Field(0, ge=0, description="older NCCL: CGA cluster size (0: none)")


def nccl_version() -> tuple[int, ...]:
    version = torch.cuda.nccl.version()
    return tuple(version) if isinstance(version, tuple) else (version // 10000, version // 100 % 100, version % 100)


class SmFreeComm(MeasuredComm):
    name: ClassVar[str] = "sm_free"
    Config = SmFreeConfig
    config: SmFreeConfig
    path: str = ""

    def setup(self, env: DistEnv) -> None:
        if env.backend != "nccl":
            raise ValueError(
                f"comm.strategy 'sm_free' needs the NCCL backend (its CTA policy and caps are NCCL communicator "
                f"options); this run's backend is {env.backend!r} on {env.device.type}. Use comm.strategy "
                "'overlap' or 'default' there"
            )
        super().setup(env)

    def nccl_options(self) -> tuple[Any, str]:
        """``ProcessGroupNCCL.Options`` for the loaded NCCL, and the name of the path it takes."""
        from torch.distributed import ProcessGroupNCCL  # type: ignore[attr-defined]

        options = ProcessGroupNCCL.Options()
        config = options.config
        if nccl_version() >= (2, 28) and hasattr(config, "cta_policy"):
            config.cta_policy = self.config.cta_policy
            return options, "cta_policy_zero"
        config.max_ctas, config.min_ctas = self.config.max_ctas, self.config.min_ctas
        config.cga_cluster_size = self.config.cga_cluster_size
        return options, "cta_caps"

    def configure_ddp(self, ddp: DistributedDataParallel) -> None:
        group = self._ddp_group(ddp)
        if os.environ.setdefault("NCCL_NVLS_ENABLE", "0") != "0":
            raise ValueError("comm.strategy 'sm_free' keeps NVLink multicast off; the environment sets NCCL_NVLS_ENABLE != 0")
        options, self.path = self.nccl_options()
        own = dist.new_group(dist.get_process_group_ranks(group), backend="nccl", pg_options=options, timeout=self.env.timeout)
        ddp.register_comm_hook(own, default_hooks.allreduce_hook)

    def measurements(self) -> dict[str, float]:
        out = super().measurements()
        if self.path:
            out[f"sm_free.path.{self.path}"] = 1.0
        return out
