"""The metrics as TensorBoard scalars (``trainer.tensorboard: true``), beside ``metrics.jsonl``.

Every record the run writes to ``metrics.jsonl`` is also written here, one scalar per number, at the
record's ``step``: a step record's keys go under ``train/`` (``train/loss``, ``train/tokens_per_s``,
``train/mfu``, ...), evaluation keys keep their split (``valid/hr@10``). Step records also get the
memory: ``memory/peak_allocated_gib`` (CUDA, since the start or the last reset) or
``memory/max_rss_gib`` (the process's peak resident set, on any device).

Written with ``torch.utils.tensorboard``, which needs the ``tensorboard`` package
(``pip install 'gem-model[tensorboard]'``).
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from typing import Any

import torch

from gem_model.errors import GemError

INSTALL_HINT = "pip install 'gem-model[tensorboard]'"
SUBDIR = "tensorboard"


class TensorBoardUnavailableError(GemError):
    """``trainer.tensorboard`` is on but the tensorboard package is not installed."""


def memory_scalars() -> dict[str, float]:
    out: dict[str, float] = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    out["memory/max_rss_gib"] = rss / (2**30 if sys.platform == "darwin" else 2**20)
    return out


class TensorBoardWriter:
    """Writes metric records as scalars into ``log_dir`` (an event file per run, flushed per record)."""

    def __init__(self, log_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise TensorBoardUnavailableError(
                f"trainer.tensorboard needs the tensorboard package ({exc}): {INSTALL_HINT}, or set "
                "trainer.tensorboard=false"
            ) from None
        self.log_dir = log_dir
        self._writer: Any = SummaryWriter(log_dir=str(log_dir))

    def write(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, int | float)}
        if "loss" in record:
            scalars.update(memory_scalars())
        for key, value in scalars.items():
            self._writer.add_scalar(key if "/" in key else f"train/{key}", float(value), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
