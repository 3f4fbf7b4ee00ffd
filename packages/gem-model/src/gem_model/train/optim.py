"""The embedding tables' optimizers, by name (``trainer.sparse_optimizer``).

- ``rowwise_adagrad``: one Adagrad accumulator per table row (torchrec's ``RowWiseAdagrad``; FBGEMM's
  ``EXACT_ROWWISE_ADAGRAD`` when a planner fuses it). Small state, the usual choice for huge tables.
- ``adam``: Adam with ``trainer.betas`` (``torch.optim.Adam``; FBGEMM's ``ADAM`` when fused, through
  torchrec's placeholder ``torchrec.optim.Adam``). Two
  full-size moments per table, as the HSTU paper's trainer uses for its (small) item table.
- ``sgd``: plain SGD (``torch.optim.SGD``; FBGEMM's ``EXACT_SGD`` when fused), no state: averaging
  the weights of table replicas after a step equals averaging their gradients before it.

All take ``trainer.sparse_lr``; the first two ``trainer.sparse_eps`` too. ``trainer.warmup_steps`` scales both
learning rates, dense and sparse, by :func:`warmup_factor` of the step (:func:`set_learning_rate`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torchrec.optim import optimizers as torchrec_optimizers
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from gem_model.components import SparseOptimizerSpec
from gem_model.config import TrainerConfig


def _rowwise_adagrad(tc: TrainerConfig) -> SparseOptimizerSpec:
    return SparseOptimizerSpec(RowWiseAdagrad, {"lr": tc.sparse_lr, "eps": tc.sparse_eps}, name="rowwise_adagrad")


def _adam(tc: TrainerConfig) -> SparseOptimizerSpec:
    b1, b2 = tc.betas
    return SparseOptimizerSpec(
        torch.optim.Adam,
        {"lr": tc.sparse_lr, "betas": (b1, b2), "eps": tc.sparse_eps},
        # torchrec's placeholder class takes FBGEMM's argument names (torch's Adam would refuse them)
        fused_cls=torchrec_optimizers.Adam,
        fused_kwargs={"lr": tc.sparse_lr, "beta1": b1, "beta2": b2, "eps": tc.sparse_eps},
        name="adam",
        fused_on_cpu=False,
    )


def _sgd(tc: TrainerConfig) -> SparseOptimizerSpec:
    return SparseOptimizerSpec(torch.optim.SGD, {"lr": tc.sparse_lr}, name="sgd")


SPARSE_OPTIMIZERS: dict[str, Callable[[TrainerConfig], SparseOptimizerSpec]] = {
    "rowwise_adagrad": _rowwise_adagrad,
    "adam": _adam,
    "sgd": _sgd,
}


def sparse_optimizer_spec(tc: TrainerConfig) -> SparseOptimizerSpec:
    try:
        build = SPARSE_OPTIMIZERS[tc.sparse_optimizer]
    except KeyError:  # the config's Literal normally catches this first
        raise ValueError(
            f"trainer.sparse_optimizer {tc.sparse_optimizer!r} is not one of {sorted(SPARSE_OPTIMIZERS)}"
        ) from None
    return build(tc)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The share of the full learning rate that step ``step`` trains at (``trainer.warmup_steps``).

    Linear from ``1 / warmup_steps`` at step 0 to 1 at step ``warmup_steps - 1``, then 1. A function
    of the step alone, so a resumed run continues the schedule exactly.
    """
    return 1.0 if warmup_steps <= 0 else min(1.0, (step + 1) / warmup_steps)


def set_learning_rate(optimizer: Any, lr: float) -> None:
    """Set every param group's rate of a torch optimizer or a torchrec ``KeyedOptimizer``.

    A torchrec fused table optimizer (FBGEMM) takes its groups' ``lr`` when its ``zero_grad`` or
    ``step`` is called, and the embedding lookup's forward fixes the rate that the update inside
    backward uses: set the rate and call ``zero_grad`` before the step's forward.
    """
    for group in optimizer.param_groups:
        group["lr"] = lr
