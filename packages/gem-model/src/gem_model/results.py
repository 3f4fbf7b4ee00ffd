"""What a run hands back: a step's result, the run's summary and the report's sections.

A leaf module (nothing of ``gem_model`` is imported here), so hook specs, plugins and the trainer
can all name these types without importing each other. Re-exported from :mod:`gem_model.api`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepResult:
    """One step, reduced over the layout's loss group (the data x context ranks)."""

    step: int
    """0-based: the ``step`` the hook got. ``metrics.jsonl``, the progress line and error messages
    count from 1 (``step + 1``): the line of step 0 says ``"step": 1``."""
    loss: float
    """The normalised global loss (``task_weight`` x the task loss + ``next_item_weight`` x the next-item loss)."""
    task_loss: float
    """The tasks' BCE, mean over the global batch's samples (0.0 without tasks)."""
    next_item_loss: float
    """The sampled-softmax loss, mean over the predicted positions of the global batch."""
    samples: int
    """Samples of the global batch (each counted once, whatever the layout)."""
    tokens: int
    flops: float
    """Training FLOPs of the global batch; per GPU it is ``flops / layout.world_size``."""
    seconds: float
    """Wall time since the previous step ended (see :class:`~gem_model.train.metrics.StepClock`)."""
    out_of_time: bool = False
    """``trainer.time_limit_s`` has passed on rank 0: the loop stops after this step."""
    stop_requested: bool = False
    """A rank got SIGTERM or SIGINT: every rank stops after this step and writes a checkpoint."""
    skipped: bool = False
    """The loss was not finite and ``trainer.non_finite=skip``: no update was applied."""


@dataclass
class ReportSection:
    """A titled list of (label, value) rows; plugins add sections through ``gem_report_sections``."""

    title: str
    rows: list[tuple[str, str]]


@dataclass
class RunSummary:
    name: str
    steps: int
    first_loss: float
    last_loss: float
    wall_seconds: float
    samples_per_s: float
    tokens_per_s: float
    mfu: float
    """Model FLOPs utilisation per GPU: the run's FLOP/s divided by ``world_size`` x the peak."""
    peak_flops: float
    peak_source: str
    world_size: int
    device: str
    components: dict[str, str]
    extra: dict[str, Any] = field(default_factory=dict)
    trained_steps: int | None = None
    """Steps this invocation trained (``steps`` minus the step it resumed from); None: not known."""

    def section(self) -> ReportSection:
        rows = [("run", self.name), ("steps", str(self.steps))]
        if self.trained_steps == 0:  # a resume at trainer.steps: no loss or rate to show
            rows.append(("trained", f"nothing: the run was at step {self.steps} already (raise trainer.steps to train on)"))
        else:
            if self.trained_steps is not None and self.trained_steps != self.steps:
                rows.append(("trained", f"steps {self.steps - self.trained_steps + 1}-{self.steps} in this invocation"))
            rows += [
                ("loss (first -> last)", _losses(self.first_loss, self.last_loss)),
                ("wall time", f"{self.wall_seconds:.1f} s"),
                ("samples / s", f"{self.samples_per_s:,.0f}"),
                ("tokens / s", f"{self.tokens_per_s:,.0f}"),
                ("MFU", f"{100 * self.mfu:.2f} % per GPU of {self.peak_flops / 1e12:.3g} TFLOP/s ({self.peak_source})"),
            ]
        rows.append(("processes", f"{self.world_size} on {self.device}"))
        if self.extra.get("layout"):
            rows.append(("layout", str(self.extra["layout"])))
        rows += [(k, v) for k, v in self.components.items()]
        for key, value in sorted((self.extra.get("eval") or {}).items()):
            rows.append((key, f"{value:.4f}"))
        plan = str(self.extra.get("plan", "")).splitlines()
        if plan:
            rows.append(("placement", plan[0]))
        return ReportSection("summary", rows)


def _losses(first: float, last: float) -> str:
    if first != first:  # NaN: every step of this invocation was skipped (trainer.non_finite: skip)
        return "none: no step had a finite loss"
    return f"{first:.4f} -> {last:.4f}"
