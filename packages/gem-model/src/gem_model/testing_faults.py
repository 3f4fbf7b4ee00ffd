"""Faults and probes for the reliability tests (registered through :mod:`gem_model.testing`).

- ``inline_fault`` (callback): a dead (SIGKILL, or ``os._exit``) or stalled peer, or a device out of
  memory, in a chosen step on a chosen rank;
- ``inline_nan_forward`` (callback): a NaN loss on one rank only, in chosen steps (its peers' are finite);
- ``inline_digests`` (callback): every rank's SHA-256 of each tensor of the model state after every step
  (``on_raise``: also after a step that raised);
- ``inline_state_dump`` (callback): the run's state as loaded, written with DCP before step 1,
  to compare a resumed (or resharded) run with the checkpoint it loaded;
- ``inline_uneven`` (data source): the synthetic data, as if each rank held another copy of it.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed.checkpoint as dcp
from pydantic import Field

from gem_model.components import ComponentConfig
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.lifecycle import Callback
from gem_model.markers import hookimpl

OOM_MESSAGE = (
    "CUDA out of memory. Tried to allocate 1.86 GiB. GPU 0 has a total capacity of 79.18 GiB of which 1.64 GiB "
    "is free. Including non-PyTorch memory, this process has 77.53 GiB memory in use. Of the allocated memory "
    "66.67 GiB is allocated by PyTorch, and 9.57 GiB is reserved by PyTorch but unallocated. If reserved but "
    "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management"
)
"""torch's words for the out-of-memory error of a 300-step run on the H100 (2026-12-05)."""


class FaultConfig(ComponentConfig):
    rank: int = 1
    at_step: int = Field(5, ge=1, description="counted as the metrics count, from 1")
    fault: Literal["kill", "exit", "stall", "oom"] = "kill"
    every_attempt: bool = Field(False, description="False: only in torchrun's first attempt (no restart yet)")


class Fault(Callback):
    """A peer's fault in step ``at_step`` on ``rank``, before the step's collective: ``kill`` sends
    the process SIGKILL (a dead peer), ``exit`` leaves it with ``os._exit(1)`` (a peer that dies
    without unwinding: no exception handler, no process-group teardown), ``stall`` sleeps for good
    (a peer that hangs), ``oom`` raises the ``torch.OutOfMemoryError`` a CUDA allocation raises (worded as
    torch words it)."""

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
            if self.config.fault == "exit":
                os._exit(1)
            if self.config.fault == "oom":
                raise torch.OutOfMemoryError(OOM_MESSAGE)
            while True:
                time.sleep(3600)
        return (yield)


class NanForwardConfig(ComponentConfig):
    rank: int = 1
    from_step: int = Field(3, ge=1, description="counted as the metrics count, from 1")
    steps: int = Field(0, ge=0, description="how many steps in a row; 0: every step from from_step on")


class NanForward(Callback):
    """On ``rank`` only, the model's task loss sum is NaN in steps ``from_step`` .. (``steps`` of
    them): a non-finite forward on one rank of many (an overflow in one rank's batch), its
    peers' losses finite. Nothing else changes; the step's loss reduction (or, for ranks outside
    the loss group, its all-ranks flags) must carry it to every rank."""

    name: ClassVar[str] = "inline_nan_forward"
    Config = NanForwardConfig
    config: NanForwardConfig

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        first, count = self.config.from_step, self.config.steps
        if run.layout.rank != self.config.rank or step + 1 < first or (count and step + 1 >= first + count):
            return (yield)
        handle = run.model.register_forward_hook(_nan_task_loss)
        try:
            return (yield)
        finally:
            handle.remove()


def _nan_task_loss(module: torch.nn.Module, args: Any, out: Any) -> Any:
    return out._replace(task_loss_sum=out.task_loss_sum * float("nan"))  # the model's ModelOutput


class DigestsConfig(ComponentConfig):
    path: str
    on_raise: bool = False  # also record the state after a step that raised (marked "raised": true)


class Digests(Callback):
    """After every step, each rank appends ``{"step", "digests": {key: sha256}, "sharded": [key]}``
    to ``<path>/rank<r>.jsonl``: the SHA-256 of every tensor of the model's state dict as this rank
    holds it (its own shards of a sharded table, the local part of a DTensor), and the keys whose
    tensor is split over ranks, to compare the state across steps and, for the tensors every rank
    holds whole, across ranks, without gathering it."""

    name: ClassVar[str] = "inline_digests"
    Config = DigestsConfig
    config: DigestsConfig

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        try:
            result = yield
        except BaseException:
            if self.config.on_raise:
                self._record(run, step, raised=True)
            raise
        self._record(run, step)
        return result

    def _record(self, run: Any, step: int, **extra: bool) -> None:
        state = run.model.state_dict()
        record = {
            "step": step + 1,
            "digests": {key: _sha256(value) for key, value in state.items()},
            "sharded": [key for key, value in state.items() if _split_over_ranks(value)],
            **extra,
        }
        out = Path(self.config.path)
        out.mkdir(parents=True, exist_ok=True)
        with (out / f"rank{run.layout.rank}.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")


def _split_over_ranks(value: Any) -> bool:
    if hasattr(value, "local_shards"):  # torchrec's ShardedTensor
        return True
    return any(p.is_shard() for p in getattr(value, "placements", ()))  # a DTensor sharded on some mesh dim


def _sha256(value: Any) -> str:
    if hasattr(value, "local_shards"):  # torchrec's ShardedTensor: this rank's shards
        return tensor_digest([shard.tensor for shard in value.local_shards()])
    if hasattr(value, "to_local"):  # DTensor (FSDP2, TP)
        return tensor_digest([value.to_local()])
    return tensor_digest([value])


def tensor_digest(parts: Iterable[Any]) -> str:
    """SHA-256 of the bytes of ``parts`` in order (any dtype, bfloat16 too); a part that is no
    tensor (a module's extra state) counts by its ``repr``."""
    digest = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            digest.update(part.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
        else:
            digest.update(repr(part).encode())
    return digest.hexdigest()


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
