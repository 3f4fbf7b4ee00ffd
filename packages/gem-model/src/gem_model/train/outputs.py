"""One run, one output directory: whose ``metrics.jsonl`` it is, and trimming it on a resume.

A fresh run writes ``run.json`` (its config and world size) beside ``metrics.jsonl``. A later
fresh run in the same directory continues only a file whose ``run.json`` shows the same run
(:func:`~gem_model.train.checkpoint.config_differences`); anything else is another run's metrics
and is refused, as another run's checkpoints are. A resume from the checkpoint at step S drops the
lines after step S, so a killed and resumed run never repeats a metric line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gem_model.config import RunConfig
from gem_model.errors import ConfigError
from gem_model.train import checkpoint as ckpt
from gem_model.train.integrity import step_dirs

METRICS = "metrics.jsonl"
RUN_FILE = "run.json"


def output_dir(config: RunConfig) -> Path:
    return Path(config.trainer.output_dir.format(name=config.name))


def _identity(config: RunConfig, world_size: int) -> dict[str, Any]:
    return {"name": config.name, "world_size": world_size, "config": config.model_dump(mode="json")}


def _whose(out: Path, config: RunConfig, world_size: int) -> str | None:
    """Why ``out``'s metrics are another run's; None when they are this run's (or there are none)."""
    metrics = out / METRICS
    if not metrics.is_file() or metrics.stat().st_size == 0:
        return None
    try:
        saved = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return f"no readable {RUN_FILE} says which run wrote it"
    differs = ckpt.config_differences(saved.get("config", {}), config.model_dump(mode="json"))
    if int(saved.get("world_size", world_size)) != world_size:
        differs.insert(0, f"world size ({saved['world_size']} -> {world_size})")
    if differs:
        more = f" and {len(differs) - 8} more" if len(differs) > 8 else ""
        return f"its run's config differs in {', '.join(differs[:8])}{more}"
    return None


def check_output_dir(config: RunConfig, world_size: int) -> None:
    """Refuse, before anything is built or any process starts: ``trainer.resume=true`` with no
    checkpoint to resume, and a fresh run in a directory holding another run's ``metrics.jsonl``."""
    out = output_dir(config)
    saved = step_dirs(out / "checkpoints")
    if config.trainer.resume is True and not saved:
        raise ConfigError(
            [("trainer.resume", True, f"there is nothing to resume from: {out / 'checkpoints'} holds no "
              "checkpoint; unset trainer.resume (auto) to start a fresh run")]
        )  # fmt: skip
    if not saved:  # a fresh run: the metrics file must be this run's (one killed before its first checkpoint)
        why = _whose(out, config, world_size)
        if why is not None:
            raise ConfigError(
                [("trainer.output_dir", str(out), f"holds {METRICS} of another run ({why}); choose another "
                  "trainer.output_dir (nothing was overwritten)")]
            )  # fmt: skip


def start_metrics(out: Path, config: RunConfig, world_size: int, *, start_step: int) -> None:
    """Rank 0, before the first step: keep the metric lines up to ``start_step``; a fresh run
    (``start_step`` 0) also records whose metrics these are."""
    out.mkdir(parents=True, exist_ok=True)
    if start_step == 0:  # atomically: other ranks may be reading it in check_output_dir
        partial = out / f"{RUN_FILE}.partial"
        partial.write_text(json.dumps(_identity(config, world_size), indent=1))
        os.replace(partial, out / RUN_FILE)
    metrics = out / METRICS
    if not metrics.is_file():
        return
    kept = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(record, dict) and int(record.get("step", 0)) <= start_step:
            kept.append(line + "\n")
    metrics.write_text("".join(kept))  # in place: the open append handle writes on at the new end
