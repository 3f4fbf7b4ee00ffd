"""The dense AdamW: torch's fused implementation only where it applies, the trainer's settings always."""

from __future__ import annotations

import torch

from gem_model.config import TrainerConfig
from gem_model.train.dense_optimizer import dense_adamw, fusable


def test_cpu_parameters_keep_torchs_default_implementation_with_the_trainers_settings():
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    tc = TrainerConfig(dense_lr=3e-4, betas=(0.8, 0.95), weight_decay=0.1)
    opt = dense_adamw(params, tc)
    group = opt.param_groups[0]
    assert not fusable(params) and not group["fused"]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-4, (0.8, 0.95), 0.1)
    reference = torch.optim.AdamW([p.detach().clone().requires_grad_() for p in params], lr=3e-4, betas=(0.8, 0.95),
                                  weight_decay=0.1)  # fmt: skip
    for p, q in zip(params, reference.param_groups[0]["params"]):
        p.grad = torch.full_like(p, 0.5)
        q.grad = torch.full_like(q, 0.5)
    opt.step()
    reference.step()
    for p, q in zip(params, reference.param_groups[0]["params"]):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_only_plain_floating_cuda_parameters_are_fusable():
    assert not fusable([])
    assert not fusable([torch.nn.Parameter(torch.randn(2))])  # the CPU
    assert not fusable([torch.nn.Parameter(torch.zeros(2, device="meta"))])
    assert not fusable([torch.randn(2)])  # not a Parameter (a DTensor, for one, is not a plain Parameter either)
