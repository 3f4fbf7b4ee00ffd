"""Run identity by meaning: whether two configs are the same run.

Two configs are the same run when they resolve to the same math. Each component's options are
compared after its ``Config`` validated them (defaults filled in), so the default run and
``configs/tiny.yaml``, which spells it out, are one run. What changes the math makes another run:
the model, the data, the optimizers, the precision, the kernels, the train pipeline,
``trainer.compile``, and every component that declares itself as shaping the run
(:attr:`~gem_model.components.Component.shapes_run`: all components but communication strategies
and callbacks, unless they declare otherwise). How long a run trains, how it logs, evaluates,
checkpoints and where it writes never make it another run, nor how the sequence lookup is batched
(:data:`IGNORED_MODEL`).

:func:`differences` compares two configs (``RunConfig.model_dump(mode="json")``, as checkpoints'
``meta.json`` and ``run.json`` keep them) through :func:`identity`, reading each component's
``Config`` from the installed plugins; :mod:`gem_model.train.resume` decides with it.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from gem_model.components import (
    ActivationPolicy,
    CommStrategy,
    Component,
    DataSource,
    Kernel,
    LoadBalancer,
    ParallelPlanner,
    PrecisionScheme,
)
from gem_model.lifecycle import Callback, TrainPipeline

if TYPE_CHECKING:
    from gem_model.plugins import GemPluginManager
    from gem_model.registry import Registry

# Trainer fields that say how long a run trains, how it logs, evaluates, checkpoints and where it
# writes, how it reacts to faults: continuing a run with other values is still the same run.
IGNORED_TRAINER = frozenset(
    {
        "steps", "device", "prefetch", "log_every", "output_dir", "checkpoint_every", "checkpoint_at_end",
        "resume", "time_limit_s", "eval_every", "eval_at_end", "progress", "tensorboard", "peak_flops",
        "non_finite", "non_finite_max_skips", "loss_spike_factor", "loss_spike_window",
        "collective_timeout_s", "resume_partial", "stop_grace_s", "gc_every",
    }
)  # fmt: skip
# Model fields that say how the model reaches its values, not which values: the sequence lookup's bags
# (model.lookup_bags_per_sample) give the same rows in any number of bags. A checkpoint written before
# the field existed (one bag per sample) continues a run that uses the default.
IGNORED_MODEL = frozenset({"lookup_bags_per_sample"})
_MISSING = object()

# The config's component slots: dotted path -> (the registry that resolves it, the interface it implements).
SLOTS: dict[str, tuple[Callable[[GemPluginManager], Registry], type[Component]]] = {
    "kernels.jagged_attention": (lambda pm: pm.kernel_registry("jagged_attention"), Kernel),
    "kernels.norm_gate": (lambda pm: pm.kernel_registry("norm_gate"), Kernel),
    "kernels.next_item_loss": (lambda pm: pm.kernel_registry("next_item_loss"), Kernel),
    "precision.scheme": (lambda pm: pm.precision_schemes, PrecisionScheme),
    "activation.policy": (lambda pm: pm.activation_policies, ActivationPolicy),
    "parallel.planner": (lambda pm: pm.parallel_planners, ParallelPlanner),
    "comm.strategy": (lambda pm: pm.comm_strategies, CommStrategy),
    "data.source": (lambda pm: pm.data_sources, DataSource),
    "data.balancer": (lambda pm: pm.load_balancers, LoadBalancer),
    "trainer.pipeline": (lambda pm: pm.train_pipelines, TrainPipeline),
}

# Fields added to the config after checkpoints had been written, each with the value that is what those
# runs did: a checkpoint's config that lacks one is read with it (so the run continues when the field
# keeps that value). Before kernels.next_item_loss every run computed the loss with the core's torch loss.
ADDED_FIELDS: dict[str, Any] = {"kernels.next_item_loss": {"name": "torch", "options": {}}}


def _by_meaning(ref: Any, registry: Registry, interface: type[Component]) -> dict[str, Any] | None:
    """``ref`` (``{name, options}``) with its options as the component's ``Config`` fills them,
    reduced to what the component declares as shaping the run; None when nothing of it does. A name
    no installed plugin provides (a plugin since uninstalled) counts as its interface's default
    says, its options as written; options its ``Config`` refuses are compared as written."""
    if not isinstance(ref, dict) or "name" not in ref:
        return ref
    name, options = ref["name"], ref.get("options", {})
    if name in registry:
        cls = registry.entries()[name].cls
        with contextlib.suppress(ValidationError):
            options = cls.Config.model_validate(options).model_dump(mode="json")
        shapes = cls.shapes_run
    else:
        shapes = interface.shapes_run
    if shapes is False:
        return None
    if shapes is not True:
        options = {k: v for k, v in options.items() if k in shapes}
    return {"name": name, "options": options}


def identity(dump: dict[str, Any], pm: GemPluginManager) -> dict[str, Any]:
    """What of the config ``dump`` makes the run what it is (see the module's docstring)."""
    out = copy.deepcopy(dump)
    for path, value in ADDED_FIELDS.items():
        parent_key, _, key = path.rpartition(".")
        parent = out.get(parent_key)
        if isinstance(parent, dict) and key not in parent:
            parent[key] = copy.deepcopy(value)
    for path, (registry, interface) in SLOTS.items():
        parent_key, _, key = path.rpartition(".")
        parent = out.get(parent_key)
        if isinstance(parent, dict) and key in parent:
            resolved = _by_meaning(parent[key], registry(pm), interface)
            if resolved is None:
                del parent[key]
            else:
                parent[key] = resolved
    callbacks = {}
    for ref in out.pop("callbacks", None) or []:
        resolved = _by_meaning(ref, pm.callbacks, Callback)
        if isinstance(resolved, dict) and "name" in resolved:
            callbacks[resolved["name"]] = resolved["options"]
    if callbacks:
        out["callbacks"] = callbacks
    for section, ignored in (("trainer", IGNORED_TRAINER), ("model", IGNORED_MODEL)):
        fields = out.get(section)
        if isinstance(fields, dict):
            out[section] = {k: v for k, v in fields.items() if k not in ignored}
    return out


def _flatten(value: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = value


def differences(saved: dict[str, Any], current: dict[str, Any], pm: GemPluginManager) -> list[str]:
    """The dotted config fields, of those that make a run what it is, where ``saved`` and
    ``current`` differ, each as ``field (saved -> current)``."""
    a: dict[str, Any] = {}
    b: dict[str, Any] = {}
    _flatten(identity(saved, pm), "", a)
    _flatten(identity(current, pm), "", b)
    out = []
    for key in sorted(set(a) | set(b)):
        x, y = a.get(key, _MISSING), b.get(key, _MISSING)
        if x != y:
            out.append(f"{key} ({_show(x)} -> {_show(y)})")
    return out


def _show(value: Any) -> str:
    return "unset" if value is _MISSING else json.dumps(value)
