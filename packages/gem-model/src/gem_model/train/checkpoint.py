"""Checkpoints with ``torch.distributed.checkpoint``: model, both optimizers, data position, RNG.

Layout under ``<output_dir>/checkpoints``::

    step_00000120/          a complete checkpoint (DCP files + meta.json + plan.json + manifest.json)
    step_00000140.partial/  being written; renamed only once every rank has finished

A checkpoint becomes visible by an atomic rename after all ranks wrote their part and rank 0 wrote
the manifest (a checksum per file, :mod:`gem_model.train.integrity`) last, so a crash or a NaN stop
never leaves a half-written "latest" checkpoint, and earlier ones are never touched. Whether and
what to resume is :mod:`gem_model.train.resume`'s decision; reading never runs a checkpoint's code
(:mod:`gem_model.train.safe_load`). Which checkpoints a step trained from is kept beside them, in
``<output_dir>/soundness.json`` (:mod:`gem_model.train.soundness`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from gem_model.distributed import DistEnv
from gem_model.errors import CheckpointError, CheckpointWriteError, UnsafeCheckpointError
from gem_model.train import soundness
from gem_model.train.integrity import MANIFEST, PARTIAL, step_dirs, write_manifest
from gem_model.train.peers import collective
from gem_model.train.safe_load import SafeLoadPlanner, SafeReader
from gem_model.train.storage import describe_failure, free_space


def read_meta(path: Path) -> dict[str, Any]:
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no meta.json)")
    return json.loads(meta_file.read_text())


@contextlib.contextmanager
def _single_process_quiet(env: DistEnv) -> Iterator[None]:
    """Silence DCP's "torch.distributed is disabled ... assuming the intent is to save/load in a
    single process" UserWarning in a one-process run: that is exactly the intent here, and the user
    can do nothing about it. Only that message, and only when there is no process group."""
    with warnings.catch_warnings():
        if not env.distributed:
            warnings.filterwarnings(
                "ignore",
                message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to",
                category=UserWarning,
            )
        yield


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


def latest_checkpoint(root: Path) -> Path | None:
    """The newest checkpoint a save completed (it has its manifest); not verified, see ``integrity``."""
    done = [p for p in step_dirs(root) if (p / MANIFEST).is_file()]
    return done[-1] if done else None


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the (lazy) state of every parameter, so a checkpoint can be loaded into it in place.

    Runs one step with zero gradients and learning rate 0, which leaves parameters unchanged for
    Adam-family optimizers; the state it creates is overwritten by the load.
    """
    missing = [p for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state]
    if not missing:
        return
    saved = [g["lr"] for g in optimizer.param_groups]
    grads = {p: p.grad for p in missing}
    for g in optimizer.param_groups:
        g["lr"] = 0.0
    for p in missing:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved, strict=True):
        g["lr"] = lr
    for p, grad in grads.items():
        p.grad = grad


def dense_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str]) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name instead of position (``names`` in param order)."""
    sd = optimizer.state_dict()
    state = {names[i]: dict(v) for i, v in sd["state"].items()}
    return {"state": state}


def load_dense_optimizer_state(optimizer: torch.optim.Optimizer, names: list[str], loaded: dict[str, Any]) -> None:
    sd = optimizer.state_dict()
    index = {n: i for i, n in enumerate(names)}
    missing = set(names) - set(loaded["state"])
    if missing:
        raise CheckpointError(f"the checkpoint has no dense optimizer state for {sorted(missing)[:5]}")
    sd["state"] = {index[n]: v for n, v in loaded["state"].items()}
    optimizer.load_state_dict(sd)


class Checkpointer:
    def __init__(self, root: Path, env: DistEnv, *, timeout_s: float = 600.0):
        self.root = root
        self.env = env
        self.timeout_s = timeout_s  # trainer.collective_timeout_s: a save's collectives fail after it

    def _agree(self, failed: bool) -> bool:
        """Whether any rank failed; in place of a barrier, so every rank stops together."""
        if not self.env.distributed:
            return failed
        flag = torch.tensor([1.0 if failed else 0.0], device=self.env.device)
        dist.all_reduce(flag)
        return bool(flag.item())

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any], files: dict[str, str] | None = None) -> Path:
        """Write ``state`` (DCP, every rank), ``meta.json`` and ``files`` (name -> text, rank 0).

        A failure to write (no space, permission, a read-only file system) on any rank stops every
        rank with :class:`~gem_model.errors.CheckpointWriteError` naming the step, the path, the cause
        and the free space; the partial folder is removed and the checkpoints before stay as they were.
        """
        final = step_dir(self.root, step)
        partial = final.with_name(final.name + PARTIAL)
        error: BaseException | None = None
        timeout = self.timeout_s
        with collective(f"in the checkpoint save of step {step} (DCP and its barriers)", rank=self.env.rank,
                        timeout_s=timeout):  # fmt: skip
            try:
                if self.env.is_main:
                    # a leftover of this step can only be a killed run's: this run holds the directory's lock
                    shutil.rmtree(partial, ignore_errors=True)
                    partial.mkdir(parents=True)
            except OSError as exc:
                error = exc
            if not self._agree(error is not None):
                try:
                    with _single_process_quiet(self.env):
                        dcp.save(state, checkpoint_id=str(partial))
                except (OSError, RuntimeError, CheckpointException) as exc:  # CheckpointException: DCP's, on every rank
                    error = exc
            if error is None and self.env.is_main:
                try:
                    for name, text in (files or {}).items():
                        (partial / name).write_text(text)
                    (partial / "meta.json").write_text(json.dumps({**meta, "step": step}, indent=1))
                    write_manifest(partial)  # last: a folder without it is a save that never finished
                    if final.exists():
                        shutil.rmtree(final)
                    soundness.clear(final)  # the marks of a checkpoint this one replaces
                    os.replace(partial, final)
                except OSError as exc:
                    error = exc
            failed = self._agree(error is not None)
        if failed:
            if self.env.is_main:
                shutil.rmtree(partial, ignore_errors=True)
            what = describe_failure(error, step=step, path=partial) if error is not None else (
                f"the checkpoint of step {step} could not be written to {partial}: another rank failed to write "
                f"its part (its own message names the cause); the file system here has {free_space(partial)}"
            )  # fmt: skip
            raise CheckpointWriteError(f"{what}. The partial folder was removed") from error
        return final

    def load(self, path: Path, state: dict[str, Any]) -> dict[str, Any]:
        """Load in place into ``state`` (tensors are filled, other values replaced); returns meta.

        No code of the checkpoint runs: its index and its non-tensor values are read by
        :mod:`~gem_model.train.safe_load` (allow-listed classes, ``weights_only``)."""
        meta = read_meta(path)  # another world size: train.reshard decided it can be loaded
        try:
            with _single_process_quiet(self.env):
                dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner(path))
        except CheckpointException as exc:  # DCP gathers every rank's failure: a refusal stays one
            unsafe = [e for e in (f[0] if isinstance(f, tuple) else f for f in exc.failures.values())
                      if isinstance(e, UnsafeCheckpointError)]  # fmt: skip
            if unsafe:
                raise unsafe[0] from None
            raise
        return meta


def rng_state() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
