"""The interfaces of the step and of the run's lifecycle: train pipelines and callbacks.

A :class:`TrainPipeline` runs the three stages of a step (forward and loss, backward, optimizer
step); the core runs everything between them (the global loss reduction, the non-finite guard,
the loss normalisation, gradient clipping), whichever pipeline the config names with
``trainer.pipeline``. A :class:`Callback` is a lifecycle plugin the config names in ``callbacks``:
its ``@hookimpl`` methods see the run through the :class:`~gem_model.context.RunContext`.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, ClassVar

from gem_model.components import Component

if TYPE_CHECKING:
    import torch
    from torch import nn

    from gem_model.context import Optimizers
    from gem_model.data.batch import Batch
    from gem_model.data.prefetch import StagedBatch
    from gem_model.layout import Layout


class TrainPipeline(Component):
    """How the stages of one step run. Selected by ``trainer.pipeline`` (default ``sequential``).

    The core calls, for every step: :meth:`next_batch`, :meth:`forward_and_loss`, then (after the
    loss is reduced over the layout's loss group and found finite) :meth:`backward` with the
    normalised loss, then (after clipping) :meth:`optimizer_step`. A pipeline that overlaps stages
    of consecutive steps (torchrec's ``TrainPipelineSparseDist``) owns the batches through
    :meth:`next_batch` and may start the next batch's input transfer there.
    """

    def setup(self, *, model: nn.Module, optimizers: Optimizers, feed: object, layout: Layout) -> None:
        """Called once the model is wrapped and the optimizers exist; ``feed`` has ``get(step)``
        returning a :class:`~gem_model.data.prefetch.StagedBatch`."""
        self.model, self.optimizers, self.feed, self.layout = model, optimizers, feed, layout

    def next_batch(self, step: int) -> StagedBatch:
        """This rank's batch of ``step``, staged (its host-side facts ready, tensors maybe in flight)."""
        return self.feed.get(step)  # type: ignore[attr-defined]

    @abstractmethod
    def forward_and_loss(self, batch: Batch) -> object:
        """Run the model in train mode on ``batch``; return its output (a
        :class:`~gem_model.model.gem.ModelOutput`: ``task_loss_sum``, ``next_item_loss_sum``,
        ``next_item_count``, the local sums the core reduces)."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Clear the gradients the optimizers own, then back-propagate ``loss``. A fused table
        optimizer (torchrec) updates the tables inside this call."""

    @abstractmethod
    def optimizer_step(self) -> None:
        """Apply the update (the gradients were clipped by the core where ``trainer.grad_clip`` is set)."""


class Callback(Component):
    """A lifecycle plugin, switched on only by the run config's ``callbacks: [{name, options}]``.

    Subclass it, give it a ``name`` and a ``Config``, and implement any lifecycle hook of
    :mod:`gem_model.hookspecs` as a method marked ``@hookimpl`` (``gem_run_started``,
    ``gem_train_step`` as a wrapper, ``gem_run_finished``, ``gem_report_sections``). The trainer
    builds one instance per run from the config and registers it for that run only; an installed
    callback that no config names does nothing. A callback may be :class:`~gem_model.protocols.Stateful`.
    """

    shapes_run: ClassVar[bool | frozenset[str]] = False  # it observes the run; one that changes it says so
