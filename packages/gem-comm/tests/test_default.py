"""The ``default`` strategy: identity alone, real all-reduce over gloo, untouched DDP."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import gem_comm.plugin
from gem_comm.default import DefaultComm
from gem_model.distributed import DistEnv
from gem_model.plugins import GemPluginManager


def test_plugin_registers_default():
    pm = GemPluginManager(autoload=False, plugins=[gem_comm.plugin])
    assert pm.comm_strategies.get("default").cls is DefaultComm


def test_single_process_reductions_are_the_identity():
    comm = DefaultComm()
    comm.setup(DistEnv(0, 1, 0, torch.device("cpu"), None))
    x = torch.tensor([1.0, 2.0])
    assert torch.equal(comm.all_reduce_sum(x), x) and torch.equal(comm.all_reduce_mean(x), x)
    assert comm.embedding_qcomms() is None


def _worker(rank: int, world: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        comm = DefaultComm()
        comm.setup(DistEnv(rank, world, rank, torch.device("cpu"), "gloo"))
        values = torch.tensor([float(rank + 1), 10.0 * rank])
        summed = comm.all_reduce_sum(values)
        mean = comm.all_reduce_mean(values)
        assert torch.equal(values, torch.tensor([float(rank + 1), 10.0 * rank])), "input must not change"
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        comm.configure_ddp(model)
        torch.manual_seed(rank)
        model(torch.randn(4, 2)).sum().backward()
        results[rank] = (summed.tolist(), mean.tolist(), model.module.weight.grad.clone())
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_two_gloo_processes_reduce_and_ddp_averages(tmp_path):
    world = 2
    with mp.Manager() as manager:
        results = manager.dict()
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        mp.spawn(_worker, args=(world, str(tmp_path / "init"), results), nprocs=world, join=True)
        r = dict(results)
    assert r[0][0] == r[1][0] == [3.0, 10.0]
    assert r[0][1] == r[1][1] == [1.5, 5.0]
    assert torch.equal(r[0][2], r[1][2])  # DDP's own all-reduce left in place: identical gradients
