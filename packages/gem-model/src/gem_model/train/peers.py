"""Dead and stalled peers, and ranks that disagree on the data.

A collective that fails (a peer's process died: the connection drops at once; a peer stalled:
the wait runs past ``trainer.collective_timeout_s``, the process group's timeout) raises
:class:`~gem_model.errors.PeerError` naming the collective, the step and this rank; this rank
then exits non-zero and torchrun stops the others (SIGTERM, then SIGKILL after its shutdown grace,
``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, 30 s by default), so no process is left behind.

Before the first step every rank compares what it reads of the data with the others: the steps
of an epoch and the global batch lengths of step 1. A rank reading another copy of the data (a
different file, a partial download) would otherwise run out of batches or train on other
samples, and stall its peers mid-epoch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gem_model.components import CommStrategy
from gem_model.data.loader import ShardedLoader
from gem_model.errors import GemError, PeerError


@contextlib.contextmanager
def collective(what: str, *, rank: int, timeout_s: float) -> Iterator[None]:
    """Around one collective: its failure becomes a :class:`PeerError` naming ``what`` and ``rank``."""
    try:
        yield
    except GemError:
        raise
    except RuntimeError as exc:  # torch.distributed.DistBackendError and gloo's errors among them
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise PeerError(
            f"rank {rank}: the collective {what} failed: a peer died, or stalled longer than "
            f"trainer.collective_timeout_s={timeout_s:g} s ({cause})"
        ) from exc


def check_same_data(loader: ShardedLoader, comm: CommStrategy, *, rank: int, world_size: int, device: torch.device,
                    timeout_s: float, refused: bool = False) -> bool:  # fmt: skip
    """Every rank's steps per epoch and step 1's global batch lengths, compared before step 1.

    The same all-reduce carries whether this rank refuses to start (rank 0 found the output
    directory locked by another run): returns whether any rank did, so that all stop together."""
    if world_size < 2:
        return refused
    per_epoch = loader.source.steps_per_epoch(loader.global_batch_size)
    lengths = loader.source.lengths(0, loader.global_batch_size)
    facts = torch.zeros(world_size, 4, dtype=torch.float64)
    epoch = -1.0 if per_epoch is None else per_epoch
    facts[rank] = torch.tensor([epoch, lengths.numel(), lengths.sum(), float(refused)])
    with collective("all_reduce of the data facts (before step 1)", rank=rank, timeout_s=timeout_s):
        every = comm.all_reduce_sum(facts.to(device), group=None).cpu()
    if bool(every[:, 3].any()):
        return True
    data = every[:, :3]
    if bool((data == data[0]).all()):
        return False
    rows = [
        f"rank {r}: {'endless' if f[0] < 0 else int(f[0])} steps per epoch, step 1 of {int(f[1])} samples "
        f"with {int(f[2])} history items"
        for r, f in enumerate(data.tolist())
    ]
    raise PeerError(
        f"the ranks read different data (data.source {loader.source.name!r}, global batch "
        f"{loader.global_batch_size}), found before step 1: {'; '.join(rows)}. Every rank must read the "
        "same data: the same files, fully copied, on every node"
    )
