"""The ``default`` strategy: identity alone, real all-reduce over gloo, untouched DDP."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.multiprocess
def test_two_gloo_processes_reduce_and_ddp_averages(spawned):
    r = {rank: out["default"] for rank, out in spawned(2).items()}  # comm_dense_cases.default_reductions
    assert r[0][0] == r[1][0] == [3.0, 10.0]
    assert r[0][1] == r[1][1] == [1.5, 5.0]
    assert torch.equal(r[0][2], r[1][2])  # DDP's own all-reduce left in place: identical gradients
