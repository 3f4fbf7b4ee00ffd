"""The core of a training step, around the train pipeline's three stages.

Whichever ``trainer.pipeline`` runs the stages, the core keeps what decides whether an update may
be applied and how large it is: the reduction of the loss sums over the layout's loss group, the
non-finite guard before any update, the loss normalisation and gradient clipping.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from gem_model.components import CommStrategy
from gem_model.config import RunConfig
from gem_model.context import Optimizers
from gem_model.errors import NonFiniteLossError
from gem_model.host_copy import to_device_async
from gem_model.layout import Layout
from gem_model.lifecycle import TrainPipeline
from gem_model.results import StepResult
from gem_model.train.clip import clip_grad_norm
from gem_model.train.loss_check import (
    LossNotFinite,
    PendingSums,
    StepSums,
    TableGate,
    check_in_backward,
    refuse_non_finite,
)
from gem_model.train.metrics import StepClock
from gem_model.train.optim import set_learning_rate, warmup_factor
from gem_model.train.peers import collective
from gem_model.train.signals import StopRequest


class CoreStep:
    """Runs step ``s`` as :meth:`__call__` (what the core's ``gem_train_step`` calls)."""

    def __init__(
        self,
        *,
        config: RunConfig,
        layout: Layout,
        comm: CommStrategy,
        pipeline: TrainPipeline,
        optimizers: Optimizers,
        dense_parameters: list[torch.nn.Parameter],
        device: torch.device,
        resume_point: Callable[[int, float], str],
        first_non_finite: Callable[[bool], str | None],
        stop: StopRequest | None = None,
        table_gate: TableGate,
    ):
        self.config, self.layout, self.comm, self.pipeline = config, layout, comm, pipeline
        self.optimizers, self.dense_parameters, self.device = optimizers, dense_parameters, device
        self.resume_point, self.first_non_finite = resume_point, first_non_finite
        self.stop = stop if stop is not None else StopRequest()  # set by SIGTERM / SIGINT (train.signals)
        self.clock = StepClock()
        self.deadline: float | None = None  # perf_counter() time when trainer.time_limit_s runs out
        self.skipped_in_a_row = 0  # steps whose update trainer.non_finite=skip skipped, consecutively
        # where the host reads the loss sums (trainer.loss_check, gem_model.train.loss_check): inside
        # backward at ``table_gate``, which the model calls before any gradient reaches a table
        self.in_backward = check_in_backward(config.trainer, layout)
        self.table_gate = table_gate

    def __call__(self, step: int) -> StepResult:
        """Forward, global loss reduction (and non-finite check) before any update, backward, update.

        At most one host synchronisation: the read of the all-reduced loss sums, before backward or, with
        ``trainer.loss_check`` at the tables, inside it once the forward has finished on the device.
        Nothing else in the step waits for the device; the batch was built (and, on CUDA, copied) ahead
        by the feed.
        """
        tc, mc = self.config.trainer, self.config.model
        self.clock.begin()
        staged = self.pipeline.next_batch(step)
        batch = staged.ready()
        if tc.warmup_steps:
            self._warm_up(step)
        out = self.pipeline.forward_and_loss(batch)
        facts = staged.facts
        late = self.deadline is not None and self.layout.rank == 0 and time.perf_counter() > self.deadline
        stop = float(self.stop.requested)
        host = torch.tensor([facts.samples, facts.tokens, facts.flops, float(late), stop], dtype=torch.float64)
        losses = [out.task_loss_sum.detach(), out.next_item_loss_sum.detach(), out.next_item_count]  # type: ignore[attr-defined]
        local = torch.cat([torch.stack([x.double() for x in losses]), to_device_async(host, self.device)])
        # The step's one host read: whether this step's update may be applied is decided from the
        # global loss before any table update, because torchrec fuses the table optimizer into
        # backward (an update, once made, cannot be undone): before backward, or inside it at the
        # tables (trainer.loss_check). One read of one small tensor carries the loss sums and
        # everything the metric record needs. The sums run over the data x context ranks: the ranks
        # of one tensor-parallel group hold the same samples.
        timeout = tc.collective_timeout_s
        if self.layout.loss_degree > 1:
            with collective(f"all_reduce of the loss sums (step {step + 1}, the loss group)", rank=self.layout.rank,
                            timeout_s=timeout):  # fmt: skip
                local = self.comm.all_reduce_sum(local, group=self.layout.loss_group)
        if self.in_backward:
            sums = self._backward_checked_at_tables(step, out, local)
            late_ranks, stop_ranks = sums.late_ranks, sums.stop_ranks
        else:
            sums = StepSums.of(local.tolist())
            late_ranks, stop_ranks, skipped = self._check_before_backward(step, sums, late, stop)
            if skipped is not None:
                return skipped
            ranks = self.layout.loss_degree
            self.pipeline.backward(self._loss(out, sums.samples / ranks, max(sums.next_count, 1.0) / ranks))
        if tc.grad_clip is not None:
            clip_grad_norm(self.dense_parameters, tc.grad_clip)  # DTensors on several meshes too (FSDP2 + TP)
        self.pipeline.optimizer_step()
        return self._result(step, sums, sums.value(mc), late_ranks, stop_ranks)

    def _result(self, step: int, sums: StepSums, value: float, late: float, stop: float, **kw: bool) -> StepResult:
        return StepResult(
            step, value, sums.task_loss, sums.next_loss, int(sums.samples), int(sums.tokens), sums.flops,
            self.clock.lap(), out_of_time=late > 0, stop_requested=stop > 0, **kw,
        )  # fmt: skip

    def _loss(self, out: object, samples: float | torch.Tensor, next_count: float | torch.Tensor) -> torch.Tensor:
        """The loss backward starts from, normalised by the global counts per loss-group rank
        (``samples`` and ``next_count``): the data-parallel gradient mean then equals the one-process
        gradient. The counts are host floats, or device tensors where the host has not read them."""
        mc = self.config.model
        task, nxt = out.task_loss_sum, out.next_item_loss_sum  # type: ignore[attr-defined]
        if isinstance(samples, torch.Tensor):
            samples, next_count = samples.to(task.dtype), next_count.to(nxt.dtype)  # type: ignore[union-attr]
        return mc.task_weight * task / samples + mc.next_item_weight * (nxt / next_count)

    def _check_before_backward(
        self, step: int, sums: StepSums, late: bool, stop: float
    ) -> tuple[float, float, StepResult | None]:
        """``trainer.loss_check=before_backward``: the late and stop counts over every rank, and the
        step's result if its update is skipped (None if it goes on); raises
        :class:`NonFiniteLossError` for a halt."""
        tc, mc = self.config.trainer, self.config.model
        late_ranks, stop_ranks = sums.late_ranks, sums.stop_ranks
        value = sums.value(mc)
        nan_ranks, inf_ranks = float(math.isnan(value)), float(math.isinf(value))
        if self.layout.loss_degree < self.layout.world_size:
            # rank 0's clock, any rank's signal and any loss group's non-finite loss decide for every
            # rank, also those outside its loss group (tp, pp peers): they must all stop after the
            # same step, and skip or apply the same updates (a NaN on one tp peer alone, which the
            # loss reduction does not reach, would otherwise let the peers' replicas diverge)
            flags = [float(late), stop, nan_ranks, inf_ranks]
            flags_on_device = to_device_async(torch.tensor(flags, dtype=torch.float64), self.device)
            with collective(f"all_reduce of the stop flags (step {step + 1}, all ranks)", rank=self.layout.rank,
                            timeout_s=tc.collective_timeout_s):  # fmt: skip
                every = self.comm.all_reduce_sum(flags_on_device, group=None)
                late_ranks, stop_ranks, nan_ranks, inf_ranks = every.tolist()
        elsewhere = ""
        if math.isfinite(value) and nan_ranks + inf_ranks > 0:
            elsewhere = f" on {int(nan_ranks + inf_ranks)} of the {self.layout.world_size} ranks (this rank's: {value})"
            value = math.nan if nan_ranks else math.inf
        if math.isfinite(value):
            self.skipped_in_a_row = 0
            return late_ranks, stop_ranks, None
        # every rank sees the same reduced loss (or flags), so every rank skips or halts at the same step
        self.skipped_in_a_row += 1
        if tc.non_finite == "skip" and self.skipped_in_a_row < tc.non_finite_max_skips:
            return late_ranks, stop_ranks, self._result(step, sums, value, late_ranks, stop_ranks, skipped=True)
        skips = (
            f" trainer.non_finite=skip skipped the updates of the {self.skipped_in_a_row - 1} step(s) before it "
            f"in a row; this is trainer.non_finite_max_skips={tc.non_finite_max_skips} in a row."
            if tc.non_finite == "skip" else ""
        )  # fmt: skip
        raise self._halt(step, sums, value, elsewhere, skips, gradients=True)

    def _backward_checked_at_tables(self, step: int, out: object, local: torch.Tensor) -> StepSums:
        """``trainer.loss_check=before_tables``: backward from a loss built on the device, the sums read
        by the host at the model's table gate (:mod:`gem_model.train.loss_check`); the halt of a
        non-finite loss raises there, before any table update."""
        mc, ranks = self.config.model, self.layout.loss_degree
        pending = PendingSums(local)
        loss = self._loss(out, local[3] / ranks, local[2].clamp(min=1.0) / ranks)
        self.table_gate.arm(lambda: refuse_non_finite(pending, mc))
        try:
            self.pipeline.backward(loss)
        except LossNotFinite:
            pass  # the gate refused it before any table update: the halt below
        finally:
            self.table_gate.disarm()
        sums = pending.get()
        if not math.isfinite(sums.value(mc)):  # also where no gradient came through the gate (no table trained)
            raise self._halt(step, sums, sums.value(mc), "", "", gradients=False)
        return sums

    def _halt(self, step: int, sums: StepSums, value: float, elsewhere: str, skips: str, *, gradients: bool
              ) -> NonFiniteLossError:  # fmt: skip
        """The error of a halt for a non-finite loss; ``gradients``: whether this rank's gradients are
        older than the loss (a check before backward) and may be named as its first non-finite value."""
        made_by = "another rank's forward" if elsewhere else "this forward"
        first = self.first_non_finite(gradients)
        if first is None:
            what = "parameter and gradient" if gradients else "parameter"
            first = f"none (every {what} is finite: {made_by} made it)"
        return NonFiniteLossError(
            f"step {step + 1} (rank {self.layout.rank}): the loss is {value}{elsewhere} (task {sums.task_loss}, "
            f"next-item {sums.next_loss}); the run stopped before applying this step's update.{skips} First "
            f"non-finite {'parameter or gradient' if gradients else 'parameter'} on this rank: {first}. "
            f"{self.resume_point(step + 1, value)}"
        )

    def _warm_up(self, step: int) -> None:
        """Set both optimizers' rates for ``step`` (``trainer.warmup_steps``), before its forward."""
        tc = self.config.trainer
        factor = warmup_factor(step, tc.warmup_steps)
        set_learning_rate(self.optimizers.dense, tc.dense_lr * factor)
        set_learning_rate(self.optimizers.sparse, tc.sparse_lr * factor)
        if self.optimizers.sparse_fused:
            # FBGEMM takes the rate its zero_grad/step last handed it, and its lookup's forward already
            # fixes the rate that the update inside backward uses: so this comes before the forward
            self.optimizers.sparse.zero_grad()
