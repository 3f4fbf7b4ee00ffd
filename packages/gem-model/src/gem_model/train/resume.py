"""Whether a run resumes, from which checkpoint, and why not: decided here, in one place.

Before anything is built (:func:`check_before_build`: ``gem-train run`` calls it before torchrun
starts, every process again before it joins the process group), each a refusal with exit 2:
- the output directory must be writable (:mod:`~gem_model.train.storage`) and held by no other
  live run (:mod:`~gem_model.train.lock`);
- ``trainer.resume=true`` needs a checkpoint to resume;
- a fresh run may not write into another run's ``metrics.jsonl`` (:mod:`~gem_model.train.outputs`).

Once the run's state exists (:func:`choose`), the checkpoints are walked newest first. One the run
from which halted non-finite (:mod:`~gem_model.train.soundness`) or whose manifest does not verify
(:mod:`~gem_model.train.integrity`) is passed over, saying why; the first left is the resume point.
With ``trainer.resume`` unset, a checkpoint of another run (:mod:`~gem_model.train.identity`) is
refused (exit 2), naming the fields and model tensors that differ; ``trainer.resume=false``
refuses any checkpoint. Before any tensor of the chosen one loads, :func:`what_to_load` refuses
what cannot load (a layout that partitions the model differently; tensors of another shape,
unless ``trainer.resume_partial``) and says what to leave fresh.

When a run halts on a non-finite value, :func:`after_halt` names the resume point that trains (the
newest checkpoint a step trained from) and the checkpoints it passed over.

The mechanics stay where they are: manifests (integrity), tensors that fit and partial loads
(compat), other world sizes (reshard), reading and writing (checkpoint, safe_load), ``run.json``
and the metrics file (outputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gem_model.config import RunConfig
from gem_model.errors import CheckpointError, ConfigError, IncompatibleCheckpointError
from gem_model.layout import Layout
from gem_model.train import checkpoint as ckpt
from gem_model.train import compat, identity, integrity, lock, outputs, reshard, soundness, storage

if TYPE_CHECKING:
    from gem_model.plugins import GemPluginManager

SHOWN_FIELDS = 8


def check_before_build(config: RunConfig, world_size: int, pm: GemPluginManager) -> None:
    """Refuse (exit 2) what can be refused before any model or process group exists."""
    out = outputs.output_dir(config)
    storage.check_writable(out)
    lock.check_free(out)
    saved = integrity.step_dirs(out / "checkpoints")
    if config.trainer.resume is True and not saved:
        raise ConfigError(
            [("trainer.resume", True, f"there is nothing to resume from: {out / 'checkpoints'} holds no "
              "checkpoint; unset trainer.resume (auto) to start a fresh run")]
        )  # fmt: skip
    if not saved:  # a fresh run: the metrics file must be this run's (one killed before its first checkpoint)
        why = outputs.whose_metrics(out, config, world_size, pm)
        if why is not None:
            raise ConfigError(
                [("trainer.output_dir", str(out), f"holds {outputs.METRICS} of another run ({why}); choose another "
                  "trainer.output_dir (nothing was overwritten)")]
            )  # fmt: skip


@dataclass
class Choice:
    """The checkpoint to resume (None: a fresh run), and the newer ones passed over, with why."""

    path: Path | None
    passed_over: list[tuple[Path, list[str]]] = field(default_factory=list)

    def report(self) -> list[str]:
        lines = [f"skipped checkpoint {path}: {'; '.join(why)}" for path, why in self.passed_over]
        if self.passed_over and self.path is not None:
            lines.append(f"falling back to {self.path}, the newest checkpoint whose manifest verifies and "
                         "that no halted run passed over")  # fmt: skip
        return lines


def choose(root: Path, config: RunConfig, world_size: int, pm: GemPluginManager, model_state: dict[str, Any]) -> Choice:
    """The checkpoint under ``root`` this run resumes, or a refusal (see the module's docstring)."""
    saved = integrity.step_dirs(root)
    if not saved:
        return Choice(None)
    if config.trainer.resume is False:
        raise CheckpointError(
            f"{root} holds checkpoints of an earlier run and trainer.resume=false; set trainer.resume=true (or "
            "leave it unset) to continue it, or choose another trainer.output_dir (nothing was overwritten)"
        )
    passed: list[tuple[Path, list[str]]] = []
    for path in reversed(saved):
        why = soundness.unsound_reason(path)
        problems = [why] if why is not None else integrity.verify(path)
        if not problems:
            choice = Choice(path, passed)
            break
        passed.append((path, problems))
    else:
        raise CheckpointError(
            f"{root} holds checkpoints but none verifies and trains, so nothing was loaded:\n  "
            + "\n  ".join(Choice(None, passed).report())
            + "\nRemove them to start afresh, or choose another trainer.output_dir"
        )
    if config.trainer.resume is None:  # auto: continue this run, refuse another's
        refuse_another_run(path, config, world_size, pm, model_state)
    return choice


def refuse_another_run(
    latest: Path, config: RunConfig, world_size: int, pm: GemPluginManager, model_state: dict[str, Any]
) -> None:
    """Refuse ``latest`` when its run's config differs from this one in what makes a run what it
    is, or its world size does; name the fields, and the model tensors that differ."""
    meta = ckpt.read_meta(latest)
    differs = identity.differences(meta.get("config", {}), config.model_dump(mode="json"), pm)
    if int(meta.get("world_size", world_size)) != world_size:
        differs.insert(0, f"world size ({meta['world_size']} -> {world_size})")
    if not differs:
        return
    more = f" and {len(differs) - SHOWN_FIELDS} more" if len(differs) > SHOWN_FIELDS else ""
    fit = compat.compare(latest, {"model": model_state}, meta.get("config", {}), config.data.global_batch_size)
    shapes = f" Its model: {fit.describe()}." if fit.mismatched else ""
    raise IncompatibleCheckpointError(
        f"{latest.parent} holds checkpoints of another run ({latest.name}); its config differs in "
        f"{', '.join(differs[:SHOWN_FIELDS])}{more}.{shapes} Choose another trainer.output_dir, or set "
        "trainer.resume=true to load it anyway (nothing was overwritten)"
    )


def what_to_load(
    path: Path, meta: dict[str, Any], state: dict[str, Any], config: RunConfig, layout: Layout, pm: GemPluginManager
) -> tuple[set[str], list[str]]:
    """Before any tensor of ``path`` loads: refuse what cannot load (another layout, tensors that do
    not fit without ``trainer.resume_partial``); else the dotted keys to leave fresh, and what to tell."""
    saved_world, world = int(meta.get("world_size", layout.world_size)), layout.world_size
    if saved_world != world:
        reshard.check(path, meta, layout)
    fit = compat.compare(path, state, meta.get("config", {}), config.data.global_batch_size)
    differs = identity.differences(meta.get("config", {}), config.model_dump(mode="json"), pm)
    if saved_world != world:
        differs.insert(0, f"world size ({saved_world} -> {world})")
    compat.check(path, fit, differs, partial=config.trainer.resume_partial)
    skip, notes = set(fit.keys), []
    if saved_world != world:
        skip |= reshard.rank_keys(state)
        notes.append(
            f"resharded {path} from {saved_world} to {world} processes; each rank's RNG starts afresh from its seed"
        )
    if fit.mismatched:
        notes.append(f"trainer.resume_partial: loaded {path} but for {fit.describe()}; those keep this run's fresh "
                     "initialisation")  # fmt: skip
    return skip, notes


def resume_point(root: Path, known: soundness.Soundness) -> str:
    """The checkpoint a new run should resume, in words: the newest one a step trained from."""
    point = known.sound
    if point is None:  # this run proved none: an earlier run's, marked on disk
        point = next((p for p in reversed(integrity.step_dirs(root)) if soundness.is_sound(p)), None)
    if point is not None:
        return f"{point} (a step trained from it)"
    left = [p for p in integrity.step_dirs(root) if soundness.unsound_reason(p) is None]
    if left:
        return f"none is known to train yet; the newest left is {left[-1]} (no step has run from it)"
    return "none written yet" if not integrity.step_dirs(root) else "none (every checkpoint was passed over)"


def after_halt(root: Path, known: soundness.Soundness, *, step: int, loss: float) -> str:
    """Step ``step`` halted on the non-finite ``loss``: mark the checkpoints it proves do not train,
    and say which checkpoint to resume and which were passed over."""
    passed = known.halted(step, loss)
    text = f"Resume point: {resume_point(root, known)}"
    if passed:
        names = ", ".join(p.name for p in passed)
        text += (f"; passed over {names}: the run from it halted at this step before any step trained, so an "
                 "automatic resume skips it")  # fmt: skip
    return text
