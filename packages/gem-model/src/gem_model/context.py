"""The run context: the narrow, documented view of a run that lifecycle hooks and callbacks get.

Hooks receive a :class:`RunContext` (as the argument ``run``), never the trainer's own objects.
Everything on it is listed below; nothing else of the trainer is part of the plugin interface.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gem_model.components import CommStrategy
    from gem_model.config import RunConfig
    from gem_model.layout import Layout
    from gem_model.plan import Plan
    from gem_model.results import StepResult


@dataclass
class Optimizers:
    """The run's two optimizers: AdamW over the dense parameters and the tables' optimizer."""

    dense: torch.optim.Optimizer
    dense_names: list[str]
    """Names of the dense parameters, in the optimizer's order (checkpoints key state by name)."""
    sparse: Any
    """A torchrec ``KeyedOptimizer`` over the tables (``state_dict`` / ``load_state_dict``)."""
    sparse_fused: bool
    """True when the tables' update runs inside backward (torchrec's fused kernels)."""
    after_step: Callable[[], None] | None = None
    """The planner's :attr:`~gem_model.components.PreparedModel.after_optimizer_step`, run by :meth:`step`."""

    def zero_grad(self) -> None:
        self.dense.zero_grad(set_to_none=True)
        if not self.sparse_fused:
            self.sparse.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.dense.step()
        if not self.sparse_fused:
            self.sparse.step()
        if self.after_step is not None:
            self.after_step()


@dataclass
class RunContext:
    """What a hook may read of a run (and, for the optimizers and model, use).

    - ``config``: the validated :class:`~gem_model.config.RunConfig`.
    - ``layout``: the :class:`~gem_model.layout.Layout` (degrees, this rank's coordinates, groups).
    - ``plan``: the planner's :class:`~gem_model.plan.Plan` (plain data).
    - ``model``: the prepared module, called as ``model(batch)`` (wrapped by the planner).
    - ``optimizers``: :class:`Optimizers`.
    - ``comm``: the run's :class:`~gem_model.components.CommStrategy` (every collective goes through it).
    - ``output_dir``: where the run writes metrics and checkpoints.
    - ``device``: this rank's device.
    - ``step``: the step running now (inside ``gem_train_step``), or the steps done (after the loop).
    """

    config: RunConfig
    layout: Layout
    plan: Plan
    model: nn.Module
    optimizers: Optimizers
    comm: CommStrategy
    output_dir: Path
    device: torch.device
    step: int = 0
    _execute_step: Callable[[int], StepResult] | None = field(default=None, repr=False)
    """The core's step, called by the core's own ``gem_train_step``; not for plugins."""

    @property
    def is_main(self) -> bool:
        """True on the rank that prints and writes the metrics file (global rank 0)."""
        return self.layout.rank == 0
