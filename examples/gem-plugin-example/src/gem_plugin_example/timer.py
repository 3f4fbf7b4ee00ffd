"""``step_timer``: a callback that times the steps and reports their mean and slowest.

It reads the run only through the public :class:`gem_model.context.RunContext` (``run.step``,
``run.layout``, ``run.is_main``, ``run.output_dir``) and switches on only when a run config lists
it: ``callbacks: [{name: step_timer, options: {skip_first: 1}}]``. Its count of timed steps is its
state, so a resumed run goes on counting (``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import json
import time
from typing import ClassVar

import torch
from pydantic import Field

from gem_model.api import Callback, ComponentConfig, ReportSection, RunContext, RunSummary, StepResult, hookimpl


class StepTimerConfig(ComponentConfig):
    skip_first: int = Field(1, ge=0, description="steps of each run left out of the statistics (warm-up)")
    write_json: bool = Field(False, description="also write step_timer.json to the run's output directory")


class StepTimer(Callback):
    name: ClassVar[str] = "step_timer"
    Config = StepTimerConfig
    config: StepTimerConfig

    def __init__(self, config: StepTimerConfig | None = None):
        super().__init__(config)
        self.seconds: list[float] = []
        self.steps_timed = torch.zeros((), dtype=torch.int64)
        self._seen = 0

    @hookimpl(wrapper=True)
    def gem_train_step(self, run: RunContext, step: int):
        start = time.perf_counter()
        result: StepResult = yield
        self._seen += 1
        if self._seen > self.config.skip_first:
            self.seconds.append(time.perf_counter() - start)
            self.steps_timed += 1
        return result

    @hookimpl
    def gem_run_finished(self, run: RunContext, summary: RunSummary) -> None:
        if self.config.write_json and run.is_main:
            record = {"step": run.step, "layout": run.layout.describe(), "seconds": self.seconds}
            (run.output_dir / "step_timer.json").write_text(json.dumps(record))

    @hookimpl
    def gem_report_sections(self, run: RunContext, summary: RunSummary) -> list[ReportSection]:
        if not self.seconds:
            return [ReportSection("step timer", [("steps timed", "0")])]
        mean = sum(self.seconds) / len(self.seconds)
        rows = [
            ("steps timed", f"{len(self.seconds)} this run, {int(self.steps_timed)} in all"),
            ("mean step", f"{1e3 * mean:.1f} ms"),
            ("slowest step", f"{1e3 * max(self.seconds):.1f} ms"),
        ]
        return [ReportSection("step timer", rows)]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"steps_timed": self.steps_timed}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.steps_timed = state["steps_timed"].clone()
