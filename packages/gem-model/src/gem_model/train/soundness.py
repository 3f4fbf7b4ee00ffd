"""Which checkpoints train: a checkpoint is known sound once a step trained from it.

A checkpoint holds finite parameters (:meth:`~gem_model.train.run.Run.save_checkpoint` checks),
but finite is not enough: an update that leaves the weights huge (a learning-rate blow-up) writes a
checkpoint from which the next step's loss is non-finite, and a resume from it halts at once. So a
checkpoint is unproven until the first step after it has a finite loss (the step's one host sync
already reads it: no extra cost), and then marked sound; when the run from it halts non-finite
before such a step, it is marked unsound, and an automatic resume passes over it. The marks are
kept in ``<output_dir>/soundness.json`` (checkpoint folder name -> verdict), rewritten atomically
by rank 0 once per checkpoint; every rank reaches the same verdict, from the same global loss.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

MARKS = "soundness.json"


def _marks_file(checkpoint: Path) -> Path:
    return checkpoint.parent.parent / MARKS  # <output_dir>/checkpoints/step_N -> <output_dir>/soundness.json


def read_marks(checkpoint: Path) -> dict[str, Any]:
    try:
        marks = json.loads(_marks_file(checkpoint).read_text())
    except (OSError, ValueError):
        return {}
    return marks if isinstance(marks, dict) else {}


def _mark(checkpoint: Path) -> dict[str, Any]:
    mark = read_marks(checkpoint).get(checkpoint.name)
    return mark if isinstance(mark, dict) else {}


def is_sound(checkpoint: Path) -> bool:
    return _mark(checkpoint).get("sound") is True


def unsound_reason(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` does not train (from its mark), or None when nothing says so."""
    mark = _mark(checkpoint)
    if mark.get("sound") is False:
        return str(mark.get("why", "a run from it halted on a non-finite loss before any step trained"))
    return None


def _write(checkpoints: list[Path], record: dict[str, Any] | None) -> None:
    """Set (or, with ``record`` None, forget) the mark of each of ``checkpoints`` (one folder)."""
    if not checkpoints:
        return
    marks = read_marks(checkpoints[0])
    for checkpoint in checkpoints:
        if record is None:
            marks.pop(checkpoint.name, None)
        else:
            marks[checkpoint.name] = record
    target = _marks_file(checkpoints[0])
    partial = target.with_name(target.name + ".partial")
    partial.write_text(json.dumps(marks, indent=1))
    os.replace(partial, target)


def clear(checkpoint: Path) -> None:
    """Forget the mark of ``checkpoint``: a new checkpoint of that step replaces it."""
    if checkpoint.name in read_marks(checkpoint):
        _write([checkpoint], None)


class Soundness:
    """What this run knows of its checkpoints: the newest known sound, and those still unproven."""

    def __init__(self, *, writes: bool):
        self.writes = writes  # rank 0 writes the marks
        self.sound: Path | None = None
        self.unproven: list[Path] = []

    def loaded(self, checkpoint: Path) -> None:
        """The run resumed from ``checkpoint``."""
        if is_sound(checkpoint):
            self.sound = checkpoint
        else:
            self.unproven = [checkpoint]

    def written(self, checkpoint: Path) -> None:
        self.unproven.append(checkpoint)

    def trained(self, step: int, loss: float) -> None:
        """Step ``step`` (counted from 1) had the finite loss ``loss``: what came before it trains."""
        if not self.unproven:
            return
        if self.writes:
            _write(self.unproven, {"sound": True, "trained_step": step, "loss": loss})
        self.sound, self.unproven = self.unproven[-1], []

    def halted(self, step: int, loss: float) -> list[Path]:
        """Step ``step`` halted with the non-finite ``loss`` before any finite step after the unproven
        checkpoints: they do not train. Returns them, newest first."""
        passed = list(reversed(self.unproven))
        why = f"the run from it halted at step {step} on a non-finite loss ({loss}) before any step trained"
        if self.writes:
            _write(passed, {"sound": False, "halted_step": step, "loss": str(loss), "why": why})
        self.unproven = []
        return passed
