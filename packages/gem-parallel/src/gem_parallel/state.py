"""Copying full (unsharded) table weights into a sharded module's local shards."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor


def _strip(name: str) -> str:
    # DMP and DDP add wrapper prefixes; the unsharded names are what is left.
    for prefix in ("_dmp_wrapped_module.", "module."):
        while name.startswith(prefix):
            name = name[len(prefix) :]
    return name


@torch.no_grad()
def copy_full_into_shards(sharded: nn.Module, full: dict[str, torch.Tensor]) -> int:
    """For every ShardedTensor in ``sharded.state_dict()``, fill the local shards from ``full``.

    Returns the number of tensors copied. A table present in one and missing in the other is an
    error: a table is never silently left with different weights.
    """
    copied = 0
    for name, value in sharded.state_dict().items():
        if not isinstance(value, ShardedTensor):
            continue
        key = _strip(name)
        if key not in full:
            raise KeyError(f"sharded table {key!r} has no unsharded counterpart to copy from")
        src = full[key]
        for shard in value.local_shards():
            offsets = shard.metadata.shard_offsets
            sizes = shard.metadata.shard_sizes
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
            shard.tensor.copy_(src[index].to(shard.tensor.device, shard.tensor.dtype))
        copied += 1
    return copied
