"""Whether a checkpoint fits this run, read from its DCP metadata before any tensor loads.

A changed width, table size or global batch makes a checkpoint another shape than the run's
state: :func:`check` names the first mismatched tensors with both shapes, and the config fields
that differ (:func:`~gem_model.train.identity.differences`), and refuses
(:class:`~gem_model.errors.IncompatibleCheckpointError`, ``gem-train`` exits 2). Only with
``trainer.resume_partial=true`` is such a checkpoint loaded, and then only the tensors that fit;
the others keep this run's fresh initialisation and are listed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from gem_model.errors import IncompatibleCheckpointError
from gem_model.train import safe_load

SHOWN = 5
"""Mismatched tensors named in the message; the rest are counted."""
BATCH_KEY = "loader.global_batch_size"


def leaves(state: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of the nested state dict, keyed as DCP keys its files."""
    if isinstance(state, dict):
        for k, v in state.items():
            yield from leaves(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, state


def _shape(value: Any) -> tuple[int, ...] | None:
    """The global shape of a tensor, a ShardedTensor (torchrec tables) or a DTensor; None otherwise."""
    if isinstance(value, torch.Tensor) or hasattr(value, "local_shards"):
        return tuple(value.size())
    return None


def saved_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's global shape, from the checkpoint's DCP metadata (no tensor is read, and
    nothing of the checkpoint runs: :mod:`~gem_model.train.safe_load`)."""
    metadata = safe_load.read_metadata(path)
    return {
        key: tuple(md.size) for key, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
    }


@dataclass
class Fit:
    """How a checkpoint's tensors compare with this run's: ``(key, saved, here)`` for each misfit."""

    mismatched: list[tuple[str, object, object]] = field(default_factory=list)

    @property
    def keys(self) -> set[str]:
        return {key for key, _, _ in self.mismatched}

    def describe(self) -> str:
        shown = [f"{key} (checkpoint {_show(a)}, this run {_show(b)})" for key, a, b in self.mismatched[:SHOWN]]
        more = f" and {len(self.mismatched) - SHOWN} more" if len(self.mismatched) > SHOWN else ""
        return f"{len(self.mismatched)} tensor(s) differ: {', '.join(shown)}{more}"


def _show(value: object) -> str:
    if value is None:
        return "has none"
    return str(list(value)) if isinstance(value, tuple) else str(value)


def compare(path: Path, state: dict[str, Any], saved_config: dict[str, Any], batch_now: int) -> Fit:
    """The tensors of ``state`` whose shape differs from the checkpoint's (or which it lacks), in
    state order; the loader's global batch (a value, not a shape) compared from the saved config."""
    saved = saved_shapes(path)
    fit = Fit()
    for key, value in leaves(state):
        here = _shape(value)
        if here is None:
            continue
        if key == BATCH_KEY:
            batch_then = saved_config.get("data", {}).get("global_batch_size", batch_now)
            if int(batch_then) != batch_now:
                fit.mismatched.append((key, int(batch_then), batch_now))
        elif key.startswith("rng_rank") or key.startswith("components."):
            continue  # their own checks: the world size, each component's load_state_dict
        elif saved.get(key) != here:
            fit.mismatched.append((key, saved.get(key), here))
    return fit


def check(path: Path, fit: Fit, differences: list[str], *, partial: bool) -> None:
    """Refuse a checkpoint that does not fit, unless ``partial``; name tensors and config fields."""
    if not fit.mismatched or partial:
        return
    fields = ", ".join(differences) if differences else "none (the checkpoint predates this code, or a data "
    "source changed the feature spec)"
    raise IncompatibleCheckpointError(
        f"{path} does not fit this run (nothing was loaded): {fit.describe()}. The config fields that differ: "
        f"{fields}. Set trainer.resume_partial=true to load the tensors that fit and keep this run's fresh "
        "initialisation of the others, or choose another trainer.output_dir"
    )


def loadable(state: dict[str, Any], skip: set[str], prefix: str = "") -> dict[str, Any]:
    """``state`` without the leaves ``skip`` (dotted keys): the same tensor objects, so DCP fills
    them in place and the skipped ones keep their values."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            kept = loadable(v, skip, key)
            if kept or not v:  # a dict emptied by ``skip`` is left out: DCP would look for it
                out[k] = kept
        elif key not in skip:
            out[k] = v
    return out
