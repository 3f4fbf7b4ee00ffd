"""Process-group set-up and tear-down on torch.distributed (torchrun, NCCL or gloo)."""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import sys
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None
    timeout_s: float = 600.0
    """How long a collective waits for a peer before it fails (``trainer.collective_timeout_s``): the
    process group's timeout, and that of every group the run makes (:func:`group_timeout`)."""

    @property
    def distributed(self) -> bool:
        return self.backend is not None

    @property
    def timeout(self) -> datetime.timedelta:
        """:attr:`timeout_s` as ``torch.distributed``'s ``new_group(timeout=...)`` takes it."""
        return datetime.timedelta(seconds=self.timeout_s)

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


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """The store of this torchrun attempt, when the agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``).

    The agent keeps one store for every restart (``--max-restarts``), so the keys of the failed
    attempt (a dead rank's address) are still in it, and a restarted gloo group connects to a dead
    peer ("connectFullMesh failed ... Connection refused"). A prefix per attempt keeps them apart.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    base = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
        is_master=False, timeout=timeout,
    )  # fmt: skip
    return dist.PrefixStore(f"gem/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


def init_distributed(device_preference: str = "auto", *, timeout_s: float = 600.0) -> DistEnv:
    """Join the process group torchrun set up, or describe a single process. A collective that
    waits longer than ``timeout_s`` for a peer fails (``trainer.collective_timeout_s``)."""
    if not launched_by_torchrun():
        return DistEnv(0, 1, 0, pick_device(device_preference, 0), None)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_preference, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    else:  # a second run in the same processes: its timeout, not the first one's
        group_timeout(dist.group.WORLD, timeout_s)
    return DistEnv(dist.get_rank(), dist.get_world_size(), local_rank, device, backend, timeout_s)


def group_timeout(group: dist.ProcessGroup, timeout_s: float) -> None:
    """Give ``group`` the run's collective timeout (``DistEnv.timeout_s``).

    A group made without a ``timeout`` does not take the default group's: ``torch.distributed`` gives
    it its backend's default (30 minutes for gloo, 10 for NCCL), and ``init_device_mesh`` and
    ``DeviceMesh._flatten`` take no timeout. So a peer stalled in a collective of a mesh dim (FSDP2's
    all-gathers, TP's all-reduces) would hold its partners past ``trainer.collective_timeout_s``.
    This sets the timeout of a group that exists, as TorchTitan does for its mesh's groups (through
    ``torch.distributed``'s ``_set_pg_timeout``, the one way there is); a group this rank is not in
    is left alone."""
    from torch.distributed.distributed_c10d import _rank_not_in_group, _set_pg_timeout

    if not _rank_not_in_group(group):
        _set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)


def teardown(env: DistEnv, *, clean: bool = True) -> None:
    """Leave the process group: after a barrier when every rank finished normally (``clean``).

    Destroying the group while a peer still runs a collective (or leaving it to interpreter
    shutdown) is what aborts gloo processes at exit, so this is always called explicitly. After a
    failure a peer may never reach the barrier, so the group is destroyed without one.
    ``destroy_process_group`` only drops the registry's reference: a group that something else still
    holds (a half-built run kept alive by an exception's traceback) keeps its gloo threads until the
    interpreter tears them down, which aborts the process (SIGABRT, "terminate called without an
    active exception"); so no such reference may outlive a run (``OutputDirRefused.anew``).
    """
    if env.distributed and dist.is_initialized():
        if clean:
            dist.barrier()
        dist.destroy_process_group()


def leave_rank(code: int) -> NoReturn:
    """End a torchrun-launched rank whose run finished, without the interpreter's teardown.

    After a torchrec-sharded run one reference to its gloo group survives that Python cannot reach
    (every Python reference dropped and collected, the group destroyed); torn down with the interpreter,
    the group's threads abort the rank now and then (SIGABRT, "terminate called without an active
    exception") although the run succeeded. Everything the run wrote is closed by then; the atexit
    handlers still run, and logging and the standard streams are flushed."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
