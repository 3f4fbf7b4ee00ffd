"""AdamW over the dense parameters, in torch's fused implementation where it applies.

torch's default AdamW on CUDA is the ``foreach`` one: each of its arithmetic steps (the moments, the
bias corrections, the update) is a multi-tensor kernel of its own, about a dozen launches over the
parameter list per step, and each reads and writes the moments again. The ``fused`` implementation
runs the whole update as one multi-tensor kernel (reading parameter, gradient and moments once). It
needs every parameter to be a plain tensor on the GPU; anything else (the CPU, the DTensors of FSDP2
and tensor parallelism) keeps ``foreach``, which torch picks by default there. On an H200 (big config,
2026-12-02) the two measured the same step (foreach 0.998x, IQR 0.982-1.005; ``benchmarks/results/e2e_ab.md``):
the optimizer is 0.65 ms of a 220 ms step either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gem_model.config import TrainerConfig


def fusable(params: Sequence[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW takes every one of ``params``: plain CUDA tensors of a float type."""
    return bool(params) and all(
        type(p) is torch.nn.Parameter and p.is_cuda and p.is_floating_point() for p in params
    )


def dense_adamw(params: Sequence[torch.Tensor], tc: TrainerConfig) -> torch.optim.AdamW:
    """``trainer``'s AdamW (``dense_lr``, ``betas``, ``weight_decay``) over ``params``: fused when
    :func:`fusable`, else torch's default implementation for them."""
    return torch.optim.AdamW(
        list(params), lr=tc.dense_lr, betas=tc.betas, weight_decay=tc.weight_decay, fused=True if fusable(params) else None
    )
