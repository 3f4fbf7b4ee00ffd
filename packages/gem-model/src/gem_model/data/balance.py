"""Sample-to-rank assignment. Sequence-length-aware balancers plug in through the same interface."""

from __future__ import annotations

from typing import ClassVar

import torch

from gem_model.components import LoadBalancer


class RoundRobinBalancer(LoadBalancer):
    """Sample ``i`` goes to rank ``i % world_size``: simple, blind to sequence lengths."""

    name: ClassVar[str] = "round_robin"

    def assign(self, lengths: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        b = lengths.numel()
        if b % world_size:
            raise ValueError(
                f"data.global_batch_size: {b} samples cannot be split evenly over {world_size} ranks"
            )
        return [torch.arange(r, b, world_size) for r in range(world_size)]
