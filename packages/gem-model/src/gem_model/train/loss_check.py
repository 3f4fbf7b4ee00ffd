"""Where a step reads its reduced loss sums and refuses the update of a NaN or Inf loss.

torchrec applies the tables' optimizer inside backward (fused into the lookups' backward), so the
update of a step whose loss is not finite has to be refused before its gradient reaches a table; the
dense optimizer steps after backward. ``trainer.loss_check`` says where the host reads the sums:

- ``before_backward``: right after the forward, before backward starts. The device idles while the
  host waits for the forward, reads the sums, builds the loss and starts backward, and the host starts
  backward with no lead over the device, which the next step's host work then shows as idle too.
- ``before_tables``: when the forward ends the sums are copied to page-locked memory (queued, not
  waited for) and the loss for backward is built on the device from them. The host reads the copy
  inside backward, when the first table-output gradient comes through the model's :class:`TableGate`:
  by then the forward has long finished and the dense backward is queued behind it, so the device does
  not wait and the host keeps its lead into the next step. A non-finite loss raises there, before any
  table update, and the dense gradients made so far go with the halted step. A step cannot go on after
  its backward was abandoned (DDP's reducer refuses the next one), so ``trainer.non_finite=skip``
  needs ``before_backward``; so does a layout whose loss group is not every rank (its flags need one
  more reduction before the decision).
- ``auto``: ``before_tables`` where it can run, else ``before_backward``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gem_model.config import ModelConfig, TrainerConfig
from gem_model.layout import Layout

BEFORE_BACKWARD, BEFORE_TABLES = "before_backward", "before_tables"


@dataclass(frozen=True)
class StepSums:
    """The loss sums and the record's counts of one step, reduced over the loss group."""

    task_sum: float
    next_sum: float
    next_count: float
    samples: float
    tokens: float
    flops: float
    late_ranks: float
    stop_ranks: float

    @classmethod
    def of(cls, values: list[float]) -> StepSums:
        return cls(*values)

    @property
    def task_loss(self) -> float:
        return self.task_sum / self.samples

    @property
    def next_loss(self) -> float:
        return self.next_sum / max(self.next_count, 1.0)

    def value(self, model: ModelConfig) -> float:
        """The step's loss, as the metrics record it."""
        return model.task_weight * self.task_loss + model.next_item_weight * self.next_loss


class PendingSums:
    """The sums of ``local`` (on the step's device) copied to the host without waiting: :meth:`get`
    waits for the copy only, which was queued right after the forward."""

    def __init__(self, local: torch.Tensor):
        self._sums: StepSums | None = None
        self._event: torch.cuda.Event | None = None
        if local.device.type == "cuda":
            self._host = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
            self._host.copy_(local, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = local

    def get(self) -> StepSums:
        if self._sums is None:
            if self._event is not None:
                self._event.synchronize()
            self._sums = StepSums.of(self._host.tolist())
        return self._sums


class LossNotFinite(Exception):
    """Raised by the gate's check inside backward: the step's loss is NaN or Inf."""


class TableGate:
    """What the model calls on the way of a gradient into its tables (``set_table_grad_gate``), before
    any table update. A step arms it with its check; the first call runs the check, the rest pass."""

    def __init__(self) -> None:
        self._check: Callable[[], None] | None = None
        self.checks = 0  # how many armed checks ran inside backward (for tests and the record)

    def arm(self, check: Callable[[], None]) -> None:
        self._check = check

    def disarm(self) -> None:
        self._check = None

    def __call__(self) -> None:
        check, self._check = self._check, None
        if check is not None:
            self.checks += 1
            check()


def refuse_non_finite(sums: PendingSums, model: ModelConfig) -> None:
    """The gate's check: raise :class:`LossNotFinite` when the step's loss is not finite."""
    if not math.isfinite(sums.get().value(model)):
        raise LossNotFinite


def check_in_backward(trainer: TrainerConfig, layout: Layout) -> bool:
    """Whether ``trainer.loss_check`` resolves to ``before_tables`` for this layout; refuses a
    ``before_tables`` that cannot run here, naming why."""
    mode = trainer.loss_check
    if mode == BEFORE_BACKWARD:
        return False
    whole = layout.loss_degree == layout.world_size
    if mode == BEFORE_TABLES and not whole:
        raise ValueError(
            f"trainer.loss_check=before_tables: the loss group has {layout.loss_degree} of the "
            f"{layout.world_size} ranks (layout {layout}); the others' flags need a reduction before the "
            "update is decided, which only before_backward does. Use trainer.loss_check=before_backward or auto"
        )
    return whole and trainer.non_finite == "halt"
