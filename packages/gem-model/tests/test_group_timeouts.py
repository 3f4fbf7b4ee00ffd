"""Every group of the mesh waits ``trainer.collective_timeout_s`` for a stalled peer, as the world group does.

``init_device_mesh`` makes the groups of a mesh dim without a timeout, so ``torch.distributed`` gave them
its backend's default (30 minutes for gloo): a peer stalled inside an FSDP2 or TP collective held its
partners for half an hour, whatever ``trainer.collective_timeout_s`` said. 4 real gloo processes, as
torchrun starts them, build the ``dp_shard=2 x tp=2`` layout with a 2 s timeout; rank 3 stalls (sleeps
without calling the collective) while the other ranks all-reduce over their ``tp`` group. Rank 3's
partner must fail after about 2 s, the other pair must finish; rank 3 leaves after 12 s, so a partner
that waited for it instead of timing out fails only then (with a closed connection, not a timeout).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.multiprocess

WORLD, TIMEOUT_S, STALLED, STALL_S = 4, 2.0, 3, 12.0


def _rank(rank: int, port: int, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")  # fmt: skip
    from gem_model.distributed import init_distributed
    from gem_model.layout import Layout
    from gem_model.parallel_dims import ParallelDims

    env = init_distributed("cpu", timeout_s=TIMEOUT_S)
    layout = Layout.build(ParallelDims(dp_shard=2, tp=2).resolve(WORLD), env)
    tp = layout.group("tp")
    members = dist.get_process_group_ranks(tp)
    dist.barrier()  # every rank has its groups before rank 3 stalls
    if rank == STALLED:
        time.sleep(STALL_S)
        results[rank] = ("stalled", members, 0.0, "")
        os._exit(0)
    began = time.perf_counter()
    try:
        value = torch.ones(1)
        dist.all_reduce(value, group=tp)
        outcome, message = "done", str(value.item())
    except RuntimeError as exc:
        outcome, message = "failed", str(exc)
    results[rank] = (outcome, members, time.perf_counter() - began, message)
    os._exit(0)  # no teardown: a group with a timed-out peer is not destroyed cleanly


def test_a_stalled_peer_in_a_mesh_group_fails_its_partner_after_the_run_timeout(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(port, results), nprocs=WORLD, join=True, start_method="spawn")
        got = dict(results)
    assert sorted(got) == list(range(WORLD)), got
    partners = [r for r in got[STALLED][1] if r != STALLED]
    assert len(partners) == 1 and got[STALLED][1] == got[partners[0]][1], got
    for rank, (outcome, _members, seconds, message) in got.items():
        if rank == STALLED:
            continue
        if rank in partners:
            assert outcome == "failed", (rank, outcome, message)
            assert "timed out waiting" in message.lower(), message  # gloo's words for a collective's timeout
            assert seconds < STALL_S / 2, (rank, seconds, message)  # ~TIMEOUT_S, far from rank 3's exit
        else:
            assert (outcome, message) == ("done", "2.0"), (rank, outcome, message)
