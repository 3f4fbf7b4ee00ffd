"""What the dense-gradient tests run in every process: the same small model under each strategy."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gem_comm.default import DefaultComm
from gem_comm.hierarchical import HierarchicalComm
from gem_comm.overlap import OverlapComm
from gem_comm.quantized import QuantizedComm
from gem_model.components import CommStrategy
from gem_model.distributed import DistEnv

STEPS = 5
BUCKET_MB = 0.001  # ~1 kB buckets: several buckets, so the hooks see more than one


def strategies(world: int) -> dict[str, CommStrategy]:
    out: dict[str, CommStrategy] = {
        "default": DefaultComm(),
        "overlap": OverlapComm(OverlapComm.Config(bucket_cap_mb=BUCKET_MB)),
        "quantized": QuantizedComm(),
        "quantized_wire": QuantizedComm(QuantizedComm.Config(accumulate="wire")),
        "hierarchical_1": HierarchicalComm(HierarchicalComm.Config(node_size=1)),
    }
    if world % 2 == 0:
        out["hierarchical_2"] = HierarchicalComm(HierarchicalComm.Config(node_size=2))
    return out


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(9, 17), nn.Tanh(), nn.Linear(17, 5))  # sizes not divisible by the world


def wrap(model: nn.Module, comm: CommStrategy, rank: int, world: int) -> DistributedDataParallel:
    comm.setup(DistEnv(rank, world, rank, torch.device("cpu"), "gloo"))
    kwargs: dict[str, Any] = {"bucket_cap_mb": BUCKET_MB, **comm.ddp_kwargs()}  # as a planner passes them
    ddp = DistributedDataParallel(model, **kwargs)
    comm.configure_ddp(ddp)
    return ddp


def train(rank: int, world: int) -> dict[str, Any]:
    """Every strategy from the same start on the same data: final parameters and measurements."""
    out: dict[str, Any] = {}
    for name, comm in strategies(world).items():
        ddp = wrap(copy.deepcopy(make_model()), comm, rank, world)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        for step in range(STEPS):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(8, 9, generator=gen), torch.randn(8, 5, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        out[name] = {"params": [p.detach().clone() for p in ddp.parameters()], "measured": comm.measurements()}
    return out


def exact_gradients(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    """One backward whose gradients are small integers: every sum is exact in any order and dtype."""
    out = {}
    for name, comm in strategies(world).items():
        torch.manual_seed(0)
        model = nn.Linear(7, 3, bias=False)
        ddp = wrap(model, comm, rank, world)
        x = torch.randint(-3, 4, (4, 7), generator=torch.Generator().manual_seed(rank)).float()
        (ddp(x) * torch.tensor([1.0, -2.0, 3.0])).sum().backward()
        out[name] = [p.grad.clone() for p in model.parameters()]
    return out


def numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def default_reductions(rank: int, world: int) -> tuple[list[float], list[float], torch.Tensor]:
    """``default`` alone: its sum and mean of per-rank values, and a gradient DDP reduced itself."""
    comm = DefaultComm()
    comm.setup(DistEnv(rank, world, rank, torch.device("cpu"), "gloo"))
    values = torch.tensor([float(rank + 1), 10.0 * rank])
    summed = comm.all_reduce_sum(values)
    mean = comm.all_reduce_mean(values)
    assert torch.equal(values, torch.tensor([float(rank + 1), 10.0 * rank])), "input must not change"
    model = DistributedDataParallel(nn.Linear(2, 1))
    comm.configure_ddp(model)
    torch.manual_seed(rank)
    model(torch.randn(4, 2)).sum().backward()
    return summed.tolist(), mean.tolist(), model.module.weight.grad.clone()
