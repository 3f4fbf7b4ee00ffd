"""Faults and probes for the reliability tests (registered through :mod:`gem_model.testing`).

- ``inline_fault`` (callback): a dead (SIGKILL) or stalled peer in a chosen step on a chosen rank;
- ``inline_state_dump`` (callback): the run's state as loaded, written with DCP before step 1,
  to compare a resumed (or resharded) run with the checkpoint it loaded;
- ``inline_uneven`` (data source): the synthetic data, as if each rank held another copy of it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import ClassVar, Literal

import torch.distributed.checkpoint as dcp
from pydantic import Field

from gem_model.components import ComponentConfig
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.lifecycle import Callback
from gem_model.markers import hookimpl


class FaultConfig(ComponentConfig):
    rank: int = 1
    at_step: int = Field(5, ge=1, description="counted as the metrics count, from 1")
    fault: Literal["kill", "stall"] = "kill"
    every_attempt: bool = Field(False, description="False: only in torchrun's first attempt (no restart yet)")


class Fault(Callback):
    """A peer's fault in step ``at_step`` on ``rank``, before the step's collective: ``kill`` sends
    the process SIGKILL (a dead peer), ``stall`` sleeps for good (a peer that hangs)."""

    name: ClassVar[str] = "inline_fault"
    Config = FaultConfig
    config: FaultConfig

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if (
            run.layout.rank == self.config.rank
            and step + 1 == self.config.at_step
            and (first_attempt or self.config.every_attempt)
        ):
            print(
                f"inline_fault: {self.config.fault} rank {run.layout.rank} in step {step + 1}",
                file=sys.stderr,
                flush=True,
            )
            if self.config.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(3600)
        return (yield)


class UnevenConfig(SyntheticConfig):
    steps_per_epoch_by_rank: list[int] = Field(default_factory=lambda: [10, 9])


class UnevenSource(SyntheticSource):
    """The synthetic data, finite, as if each rank held another copy of it: rank ``r`` (its
    ``RANK``) counts ``steps_per_epoch_by_rank[r]`` steps per epoch (a partial copy on one node)."""

    name: ClassVar[str] = "inline_uneven"
    Config = UnevenConfig
    config: UnevenConfig

    def steps_per_epoch(self, global_batch_size: int) -> int | None:
        return self.config.steps_per_epoch_by_rank[int(os.environ.get("RANK", "0"))]


class StateDumpConfig(ComponentConfig):
    path: str


class StateDump(Callback):
    """Before step 1, every rank writes the model and both optimizers' state as loaded to ``path``
    (DCP, collectively: sharded tables whole): what a resume or a reshard put into the run."""

    name: ClassVar[str] = "inline_state_dump"
    Config = StateDumpConfig
    config: StateDumpConfig

    @hookimpl
    def gem_run_started(self, run):
        from gem_model.train.checkpoint import dense_optimizer_state

        state = {
            "model": run.model.state_dict(),
            "dense_optimizer": dense_optimizer_state(run.optimizers.dense, run.optimizers.dense_names),
            "sparse_optimizer": run.optimizers.sparse.state_dict(),
        }
        dcp.save(state, checkpoint_id=self.config.path)
