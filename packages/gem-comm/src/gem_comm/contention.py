"""Compute slowdown while collectives run: a compute probe timed alone, then beside all-reduces.

:func:`compute_slowdown` runs on every rank of ``group`` at once (it issues collectives):

1. the probe alone: ``repeats`` square matmuls of side ``size`` in the default dtype, timed (best
   of ``trials``) with the device synchronised around it;
2. one all-reduce of ``nbytes`` alone (best of ``trials``), to size the next part;
3. ``k`` all-reduces launched asynchronously (``async_op=True``), the probe timed while they are in
   flight, then the wait. ``k`` is the agreed (max over the ranks) number of all-reduces that last
   at least as long as the probe alone, so the probe runs beside communication throughout.

``compute.slowdown`` is the probe's time beside the all-reduces over its time alone: 1.0 means the
collectives took nothing from the compute. On NCCL the all-reduces run on NCCL's stream, beside the
matmuls on the current stream (the SM contention of issue 15); on gloo they run on gloo's threads
beside the CPU matmuls (core contention). It measures the device and backend as they are; the
numbers are not a model of the run's own step, whose collectives have other sizes and timing.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def compute_slowdown(
    group: object = None,
    *,
    device: torch.device,
    size: int = 256,
    repeats: int = 4,
    nbytes: int = 4 << 20,
    trials: int = 3,
) -> dict[str, float]:
    """``compute.alone.seconds``, ``compute.beside_comm.seconds``, ``compute.slowdown``,
    ``comm.all_reduce.alone.seconds`` (one all-reduce of ``nbytes``) and ``comm.all_reduces``
    (how many ran beside the probe). Collective: every rank of ``group`` must call it."""
    if not dist.is_initialized():
        raise ValueError("compute_slowdown needs a process group (it runs all-reduces)")
    a = torch.randn(size, size, generator=torch.Generator().manual_seed(0)).to(device)
    buffer = torch.zeros(max(nbytes // 4, 1), dtype=torch.float32, device=device)

    def probe() -> float:
        _sync(device)
        start = time.perf_counter()
        x = a
        for _ in range(repeats):
            x = torch.tanh(x @ a)  # tanh keeps the values bounded over the repeats
        _sync(device)
        return time.perf_counter() - start

    def one_all_reduce() -> float:
        _sync(device)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)  # type: ignore[arg-type]
        _sync(device)
        return time.perf_counter() - start

    probe()  # warm-up (allocations, kernel selection)
    alone = min(probe() for _ in range(trials))
    comm = min(one_all_reduce() for _ in range(trials))
    count = torch.tensor([float(math.ceil(alone / max(comm, 1e-9)) + 1)], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)  # type: ignore[arg-type]
    k = int(count.item())
    dist.barrier(group=group)  # type: ignore[arg-type]
    works = [dist.all_reduce(buffer, group=group, async_op=True) for _ in range(k)]  # type: ignore[arg-type]
    beside = probe()
    for work in works:
        work.wait()  # type: ignore[union-attr]
    _sync(device)
    return {
        "compute.alone.seconds": alone,
        "compute.beside_comm.seconds": beside,
        "compute.slowdown": beside / alone,
        "comm.all_reduce.alone.seconds": comm,
        "comm.all_reduces": float(k),
    }
