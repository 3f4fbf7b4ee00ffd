"""One run, one output directory: whose ``metrics.jsonl`` it is, and trimming it on a resume.

A fresh run writes ``run.json`` (its config and world size) beside ``metrics.jsonl``. A later
fresh run in the same directory continues only a file whose ``run.json`` shows the same run
(:func:`~gem_model.train.identity.differences`); anything else is another run's metrics and is
refused (:func:`gem_model.train.resume.check_before_build`), as another run's checkpoints are. A
resume from the checkpoint at step S drops the lines after step S, so a killed and resumed run
never repeats a metric line; a torn line (a kill cut it short) is dropped too, and reported with
the step it held.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gem_model.config import RunConfig
from gem_model.train import identity

if TYPE_CHECKING:
    from gem_model.plugins import GemPluginManager

METRICS = "metrics.jsonl"
RUN_FILE = "run.json"


def output_dir(config: RunConfig) -> Path:
    return Path(config.trainer.output_dir.format(name=config.name))


def _run_record(config: RunConfig, world_size: int) -> dict[str, Any]:
    return {"name": config.name, "world_size": world_size, "config": config.model_dump(mode="json")}


def whose_metrics(out: Path, config: RunConfig, world_size: int, pm: GemPluginManager) -> str | None:
    """Why ``out``'s metrics are another run's; None when they are this run's (or there are none)."""
    metrics = out / METRICS
    if not metrics.is_file() or metrics.stat().st_size == 0:
        return None
    try:
        saved = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError):
        return f"no readable {RUN_FILE} says which run wrote it"
    differs = identity.differences(saved.get("config", {}), config.model_dump(mode="json"), pm)
    if int(saved.get("world_size", world_size)) != world_size:
        differs.insert(0, f"world size ({saved['world_size']} -> {world_size})")
    if differs:
        more = f" and {len(differs) - 8} more" if len(differs) > 8 else ""
        return f"its run's config differs in {', '.join(differs[:8])}{more}"
    return None


def start_metrics(out: Path, config: RunConfig, world_size: int, *, start_step: int) -> list[str]:
    """Rank 0, before the first step: keep the metric lines up to ``start_step``; a fresh run
    (``start_step`` 0) also records whose metrics these are. Returns what to tell: each torn line
    (one a kill cut short) with the steps it drops."""
    out.mkdir(parents=True, exist_ok=True)
    if start_step == 0:  # atomically: other ranks may be reading it in check_before_build
        partial = out / f"{RUN_FILE}.partial"
        partial.write_text(json.dumps(_run_record(config, world_size), indent=1))
        os.replace(partial, out / RUN_FILE)
    metrics = out / METRICS
    if not metrics.is_file():
        return []
    lines = metrics.read_text().splitlines()
    kept: list[str] = []
    steps: list[int | None] = []  # each line's step, None for a torn one
    torn: list[int] = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            torn.append(number)
            steps.append(None)
            continue
        step = int(record.get("step", 0)) if isinstance(record, dict) else 0
        steps.append(step)
        if isinstance(record, dict) and step <= start_step:
            kept.append(line + "\n")
    metrics.write_text("".join(kept))  # in place: the open append handle writes on at the new end
    return [_torn(metrics, number, lines[number - 1], steps, start_step) for number in torn]


def _torn(metrics: Path, number: int, text: str, steps: list[int | None], start_step: int) -> str:
    """What a torn line of ``metrics`` (line ``number``, 1-based) drops, in words."""
    before = next((s for s in reversed(steps[: number - 1]) if s is not None), 0)
    after = next((s for s in steps[number:] if s is not None), None)
    found = re.match(r'\s*\{\s*"step"\s*:\s*(\d+)\s*[,}]', text)
    if found:
        first = int(found.group(1))
        span = f"step {first}"
    else:  # the step it held lies between its neighbours' (a log_every > 1 leaves several possible)
        first = before + 1
        last = None if after is None else max(after - 1, first)
        span = (f"step {first}" if last == first else f"a step from {first} to {last}" if last is not None
                else f"a step after step {before}")  # fmt: skip
    redo = (f"this run logs steps after {start_step} again" if first > start_step
            else "it is lost: that step is not trained again")  # fmt: skip
    return (f"{metrics} line {number} is torn ({len(text)} characters, not JSON; a kill cut it short): dropped "
            f"its record of {span}; {redo}")  # fmt: skip
