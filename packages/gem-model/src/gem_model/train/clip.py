"""Gradient clipping by the global norm, also when the dense parameters are DTensors on several meshes.

``torch.nn.utils.clip_grad_norm_`` stacks the per-parameter norms, which DTensor refuses across
meshes: under FSDP2 with tensor parallelism the TP'd weights live on the ``dp_shard x tp`` mesh and
the rest on ``dp_shard``. So the norm is taken per mesh (a DTensor norm reduces over its mesh),
made a plain tensor, and the meshes' norms combined. With one group (every parameter a plain
tensor, or all on one mesh) it is exactly ``clip_grad_norm_``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so their global 2-norm is at most ``max_norm``; returns the norm."""
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if len(groups) <= 1:
        return torch.nn.utils.clip_grad_norm_([p for ps in groups.values() for p in ps], max_norm)
    norms = []
    for params in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])  # type: ignore[misc]
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]))
    for params in groups.values():  # one mesh at a time: a foreach op takes one mesh
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
