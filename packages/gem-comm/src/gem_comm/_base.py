"""What the measuring strategies share: ``default``'s metric reductions plus a :class:`CommMeter`,
and the check that a hook is installed on a DDP module that really averages over a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gem_comm.default import DefaultComm
from gem_comm.measure import CommMeter
from gem_model.api import DistEnv


class MeasuredComm(DefaultComm):
    """``default``'s metric reductions; the subclass installs its DDP comm hook and records into ``meter``."""

    def setup(self, env: DistEnv) -> None:
        super().setup(env)
        self.meter = CommMeter()

    def measurements(self) -> dict[str, float]:
        meter = getattr(self, "meter", None)
        return meter.totals() if meter is not None else {}

    def _ddp_group(self, ddp: DistributedDataParallel) -> dist.ProcessGroup:
        if not hasattr(self, "meter"):
            raise RuntimeError(f"comm.strategy {self.name!r}: configure_ddp was called before setup(env)")
        group = ddp.process_group
        if group is None:
            raise ValueError(f"comm.strategy {self.name!r}: the DDP module has no process group")
        return group


def flat_padded(buffer: torch.Tensor, multiple: int, dtype: torch.dtype) -> torch.Tensor:
    """``buffer`` as ``dtype``, zero-padded to a multiple of ``multiple`` elements (a copy)."""
    pad = (-buffer.numel()) % multiple
    out = torch.zeros(buffer.numel() + pad, dtype=dtype, device=buffer.device)
    out[: buffer.numel()] = buffer
    return out


def done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A completed future, what a DDP comm hook that waited for its collectives returns."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut
