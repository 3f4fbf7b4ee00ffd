"""The gem model's dense parameters at construction: the same values for the same seed on every
machine and process (drawn on the CPU from one generator, in ``named_parameters()`` order), so that a
data-parallel run's replicas start equal without a broadcast, and a run is reproducible from its seed."""

from __future__ import annotations

import torch
from torch import nn

from gem_model.config import ModelConfig


def init_dense(model: nn.Module, config: ModelConfig, seed: int) -> None:
    """Initialise every parameter of ``model`` outside its tables (``sparse.*``, which the tables' own
    initialisation covers): HSTU's relative biases ~ N(0, 0.02); the position table and the ``uvqk``
    weights ~ N(0, the config's std) when it sets one; other matrices Xavier-uniform; vectors (biases,
    norms) left as their modules made them."""
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith("sparse."):
                continue
            if name.endswith((".position_bias", ".time_bias")):  # HSTU's initialisation of its relative bias
                p.copy_(torch.empty(p.shape).normal_(0.0, 0.02, generator=g))
                continue
            if p.dim() < 2:
                continue
            std = None
            if name == "position.weight":
                std = config.position_init_std
            elif name.startswith("blocks.") and name.endswith(".uvqk.weight"):
                std = config.uvqk_init_std
            if std is not None:
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))
            else:
                bound = (6.0 / (p.shape[0] + p.shape[1])) ** 0.5
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))
