"""What a checkpoint holds: the model, both optimizers, the data position, the RNG, and the state
of every stateful component under ``components.<registry>.<name>``
(:class:`~gem_model.protocols.Stateful`: fp8 scale history, error feedback, balancer statistics)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from gem_model.context import Optimizers
from gem_model.data.loader import ShardedLoader
from gem_model.protocols import Stateful
from gem_model.train import checkpoint as ckpt


def run_state(
    *, model: nn.Module, optimizers: Optimizers, loader: ShardedLoader, rank: int, components: dict[str, dict[str, Stateful]]
) -> dict[str, Any]:
    """The state to save, or (filled in place by DCP) to load into."""
    state: dict[str, Any] = {
        "model": model.state_dict(),
        "dense_optimizer": ckpt.dense_optimizer_state(optimizers.dense, optimizers.dense_names),
        # as tensors: DCP round-trips tensors reliably in every layout, plain ints not always
        "loader": {k: torch.tensor(v, dtype=torch.int64) for k, v in loader.state_dict().items()},
        f"rng_rank{rank}": ckpt.rng_state(),
    }
    sparse = optimizers.sparse.state_dict()
    if tree_leaves(sparse):  # torchrec's fused SGD: empty dicts only, which DCP does not round-trip
        state["sparse_optimizer"] = sparse
    if components:
        state["components"] = {
            registry: {name: component.state_dict() for name, component in by_name.items()}
            for registry, by_name in components.items()
        }
    return state


def restore(
    state: dict[str, Any],
    *,
    model: nn.Module,
    optimizers: Optimizers,
    loader: ShardedLoader,
    rank: int,
    components: dict[str, dict[str, Stateful]],
) -> None:
    """Hand the loaded ``state`` back to its owners."""
    model.load_state_dict(state["model"])
    ckpt.load_dense_optimizer_state(optimizers.dense, optimizers.dense_names, state["dense_optimizer"])
    if "sparse_optimizer" in state:
        optimizers.sparse.load_state_dict(state["sparse_optimizer"])
    loader.load_state_dict({k: int(v) for k, v in state["loader"].items()})
    ckpt.set_rng_state(state[f"rng_rank{rank}"])
    for registry, by_name in components.items():
        for name, component in by_name.items():
            component.load_state_dict(state["components"][registry][name])


def prepare_for_load(optimizers: Optimizers) -> None:
    """Create the optimizers' lazy state, so a checkpoint can be loaded into it in place."""
    ckpt.init_optimizer_state(optimizers.dense)
    if not optimizers.sparse_fused:
        optimizers.sparse.init_state()
