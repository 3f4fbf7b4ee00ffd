"""Process-group set-up and tear-down on torch.distributed (torchrun, NCCL or gloo)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device(preference: str, local_rank: int) -> torch.device:
    if preference == "cuda" or (preference == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RuntimeError("trainer.device is 'cuda' but no CUDA device is visible")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(device_preference: str = "auto") -> DistEnv:
    """Join the process group torchrun set up, or describe a single process."""
    if not launched_by_torchrun():
        return DistEnv(0, 1, 0, pick_device(device_preference, 0), None)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(minutes=10))
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def teardown(env: DistEnv, *, clean: bool = True) -> None:
    """Leave the process group: after a barrier when every rank finished normally (``clean``).

    Destroying the group while a peer still runs a collective (or leaving it to interpreter
    shutdown) is what aborts gloo processes at exit, so this is always called explicitly. After a
    failure a peer may never reach the barrier, so the group is destroyed without one.
    """
    if env.distributed and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()
