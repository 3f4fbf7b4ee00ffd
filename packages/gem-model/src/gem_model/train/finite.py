"""Where a NaN or Inf sits: the first non-finite parameter, gradient or saved tensor of a model."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


def _local_tensors(value: object) -> Iterator[torch.Tensor]:
    """This rank's data of a state-dict value: a tensor, a DTensor's local part, a ShardedTensor's shards."""
    if hasattr(value, "local_shards"):  # torchrec's sharded tables
        for shard in value.local_shards():  # type: ignore[attr-defined]
            yield shard.tensor
    elif hasattr(value, "to_local"):  # DTensor (FSDP2, TP)
        yield value.to_local()  # type: ignore[attr-defined]
    elif isinstance(value, torch.Tensor):
        yield value


def _finite(t: torch.Tensor) -> bool:
    return not t.is_floating_point() or t.numel() == 0 or bool(torch.isfinite(t).all())


def first_non_finite(module: nn.Module, *, gradients: bool = True) -> str | None:
    """``parameter <name>`` or ``gradient of <name>`` or ``state <key>`` of the first NaN/Inf on this
    rank, in parameter order (then the state dict: buffers, sharded tables); None when all are finite.

    Reads every tensor once (one host sync each): for a halt or a checkpoint, never inside a step.
    """
    with torch.no_grad():
        for name, p in module.named_parameters():
            for t in _local_tensors(p):
                if not _finite(t.detach()):
                    return f"parameter {name}"
            if gradients and p.grad is not None and not all(_finite(g) for g in _local_tensors(p.grad)):
                return f"gradient of {name}"
        for key, value in module.state_dict(keep_vars=True).items():
            if not all(_finite(t.detach()) for t in _local_tensors(value)):
                return f"state {key}"
    return None
