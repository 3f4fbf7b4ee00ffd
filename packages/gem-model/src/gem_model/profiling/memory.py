"""The memory section: bytes per rank, estimated by component, and measured.

Estimated, per rank (the heaviest rank of the planner's plan for the profile's world size):

- parameters: the dense parameters (every rank holds them: DDP) plus the rank's table shards
  (``rows x dim x 4`` bytes per table, split evenly over the table's ranks unless it is replicated);
- gradients: the dense parameters' again; the tables' too unless the planner fuses their update
  into backward (a compute kernel named ``fused...``: no table gradient is ever materialised);
- optimizer state: AdamW's two moments of the dense parameters; for the tables one float per row
  (``rowwise_adagrad``) or two moments (``adam``);
- activations: measured, not modelled, for every registered activation policy: one forward and
  backward of a per-rank batch on the profile's device under :class:`LiveBytes`, which counts the
  bytes of every tensor storage created inside it while it is alive. ``saved`` is what is alive
  when the forward returns (what backward will need); ``peak`` the most alive at once over
  forward and backward (gradients included). The estimated total is static + saved.

Measured: the device allocator's peak over the step-time section's real steps
(``torch.cuda.max_memory_allocated``); the CPU has no such counter, so it says so.

Another precision config's memory (:func:`precision_memory`, which sections reach through
:meth:`ProfileContext.memory_fit <gem_model.profiling.context.ProfileContext.memory_fit>`): one step's
activation peak measured under it as above, added to the measured peak of the configured run less
the configured run's own activation peak (or, with no measured peak, to the static bytes), against
the device's memory (:func:`gem_model.footprint.device_memory`).
"""

from __future__ import annotations

import copy
import math
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gem_model.components import PrecisionScheme
from gem_model.config import ActivationConfig, ComponentRef, PrecisionConfig, RunConfig
from gem_model.data.batch import Batch
from gem_model.footprint import device_memory
from gem_model.model.gem import GemModel
from gem_model.plan import Plan
from gem_model.precision import apply_precision, set_submodule
from gem_model.profiling.context import ProfileContext, copy_sharing_tables
from gem_model.profiling.report import ProfileSection, ProfileTable, Recommendation
from gem_model.resolve import Components
from gem_model.train.prepare import apply_activation

GB = 1e9
FP32 = 4
REPLICATED = ("data_parallel", "replicated")


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages created inside the mode that are still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta" or not hasattr(t, "untyped_storage"):
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def step_loss(model: GemModel, batch: Batch) -> torch.Tensor:
    """The trainer's loss of one batch on one process, as a tensor (backward-able)."""
    out = model(batch)
    cfg = model.config
    task = out.task_loss_sum / batch.batch_size
    next_item = out.next_item_loss_sum / out.next_item_count.clamp(min=1)
    return cfg.task_weight * task + cfg.next_item_weight * next_item


def measure_activations(model: GemModel, batch: Batch) -> tuple[int, int]:
    """(saved bytes when the forward returns, peak live bytes over forward and backward)."""
    model.zero_grad(set_to_none=True)
    with LiveBytes() as meter:
        loss = step_loss(model, batch)
        saved = meter.live
        loss.backward()
        del loss
    peak = meter.peak
    model.zero_grad(set_to_none=True)
    return saved, peak


def static_bytes(config: RunConfig, model: GemModel, plan: Plan) -> dict[str, float]:
    """Parameters, gradients and optimizer state of the heaviest rank, in bytes (see the module doc)."""
    dense = float(sum(p.numel() * p.element_size() for _, p in model.dense_named_parameters()))
    ranks = max(1, int(plan.layout.get("world_size", 1)))
    tables = [0.0] * ranks
    table_grads = [0.0] * ranks
    rows_state = [0.0] * ranks
    adam = config.trainer.sparse_optimizer == "adam"
    for t in plan.tables.values():
        holders = t.ranks or [0]
        share = 1.0 if t.sharding in REPLICATED else 1.0 / len(holders)
        for r in holders:
            r = min(r, ranks - 1)
            tables[r] += t.rows * t.dim * FP32 * share
            if not t.compute_kernel.startswith("fused"):
                table_grads[r] += t.rows * t.dim * FP32 * share
            rows_state[r] += (2 * t.rows * t.dim if adam else t.rows) * FP32 * share
    heavy = max(range(ranks), key=lambda r: tables[r])
    return {
        "parameters": dense + tables[heavy],
        "gradients": dense + table_grads[heavy],
        "optimizer": 2 * dense + rows_state[heavy],
        "dense_parameters": dense,
        "table_parameters": tables[heavy],
    }


def _policy_options(config: RunConfig, name: str) -> ComponentRef:
    return config.activation.policy if config.activation.policy.name == name else ComponentRef(name=name)


def activation_bytes(
    ctx: ProfileContext, components: Components, batch: Batch, *, precision: PrecisionConfig | None = None,
    policies: list[str] | None = None,
) -> dict[str, tuple[int, int] | str]:
    """Per activation policy (default: every registered one): (saved, peak) bytes of one step under
    ``precision`` (default: the config's), or why it could not run."""
    config, device = ctx.config, ctx.device
    precision = precision or config.precision
    model = copy_sharing_tables(ctx.model())  # the profile's tables, this section's converted dense copy
    apply_precision(model, precision, _schemes_for(ctx, components, precision), device)
    model.train()
    # no table gradient: it is not an activation, and at 25 GB of tables it would dwarf them (the static
    # part counts it); the tables are shared with other sections, so their flags are put back
    tables = [p for module in model.table_modules().values() for p in module.parameters()]
    flags = [p.requires_grad for p in tables]
    for p in tables:
        p.requires_grad_(False)
    try:
        return _per_policy(ctx, model, batch, policies or ctx.plugins.activation_policies.names())
    finally:
        for p, flag in zip(tables, flags, strict=True):
            p.requires_grad_(flag)


def _schemes_for(ctx: ProfileContext, components: Components, precision: PrecisionConfig) -> dict[str, PrecisionScheme]:
    """The scheme instances ``precision`` names: the run's own where the config names them alike,
    else the registry's with the options ``precision`` gives (none for an override)."""
    out: dict[str, PrecisionScheme] = {}
    for ref in [precision.scheme, *(ComponentRef(name=n) for n in precision.overrides.values())]:
        if ref.name in out:
            continue
        mine = components.precision.get(ref.name)
        if mine is not None and (ref is not precision.scheme or ref == ctx.config.precision.scheme):
            out[ref.name] = mine
        else:
            entry = ctx.plugins.precision_schemes.get(ref.name)
            out[ref.name] = entry.cls(entry.cls.Config.model_validate(ref.options))
    return out


def _per_policy(
    ctx: ProfileContext, model: GemModel, batch: Batch, policies: list[str]
) -> dict[str, tuple[int, int] | str]:
    config = ctx.config
    blocks = {fqn: model.get_submodule(fqn) for fqn in model.activation_blocks()}
    out: dict[str, tuple[int, int] | str] = {}
    for name in policies:
        ref = _policy_options(config, name)
        entry = ctx.plugins.activation_policies.get(name)
        try:
            policy = entry.cls(entry.cls.Config.model_validate(ref.options))
            for fqn, block in blocks.items():  # a policy may change a block in place: it gets copies
                set_submodule(model, fqn, copy.deepcopy(block))
            apply_activation(model, ActivationConfig(policy=ref), {name: policy})
            out[name] = measure_activations(model, batch)
        except (RuntimeError, ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        finally:
            for fqn, block in blocks.items():
                set_submodule(model, fqn, block)
    return out


def memory_section(
    ctx: ProfileContext, components: Components, plan: Plan, batch: Batch, model_for_sizes: GemModel
) -> ProfileSection:
    fixed = static_bytes(ctx.config, model_for_sizes, plan)
    acts = activation_bytes(ctx, components, batch)
    configured = ctx.config.activation.policy.name
    base = fixed["parameters"] + fixed["gradients"] + fixed["optimizer"]
    rows, per_policy, notes = [], {}, []
    for name, value in acts.items():
        if isinstance(value, str):
            notes.append(f"activation policy {name}: {value}")
            continue
        saved, peak = value
        per_policy[name] = {"saved": saved, "peak": peak}
        rows.append([name, saved / GB, peak / GB, (base + saved) / GB])
    measured = ctx.measured.peak_memory_bytes if ctx.measured is not None else None
    if measured is None:
        notes.append(f"measured peak: not measured on {ctx.device.type} (no allocator counter)")
    summary = {**fixed, "activations": per_policy, "measured_peak": measured, "configured_policy": configured}
    recs = []
    if configured in per_policy and per_policy:
        least = min(per_policy, key=lambda n: per_policy[n]["saved"])
        total_now = base + per_policy[configured]["saved"]
        saved_bytes = per_policy[configured]["saved"] - per_policy[least]["saved"]
        if least != configured and saved_bytes > 0:
            recs.append(Recommendation(
                action=f"activation.policy={least} (when memory binds; it recomputes or compresses)",
                expected_gain=saved_bytes / total_now, metric="memory per rank",
                evidence=f"activations saved for backward {per_policy[configured]['saved'] / GB:.3g} GB under "
                f"{configured} vs {per_policy[least]['saved'] / GB:.3g} GB under {least}; static {base / GB:.3g} GB",
            ))  # fmt: skip
    fixed_rows = [["parameters", fixed["parameters"] / GB], ["gradients", fixed["gradients"] / GB],
                  ["optimizer state", fixed["optimizer"] / GB],
                  ["measured peak", "not measured" if measured is None else measured / GB]]  # fmt: skip
    return ProfileSection(
        name="memory",
        title="memory per rank (GB)",
        summary=summary,
        tables=[ProfileTable("estimated static bytes (heaviest rank)", ["what", "GB"], fixed_rows),
                ProfileTable(f"activations of one step (batch of {batch.batch_size}) per policy",
                      ["policy", "saved GB", "step peak GB", "total GB (static + saved)"], rows)],
        series={"static": {k: fixed[k] for k in ("parameters", "gradients", "optimizer")}, "activations": per_policy},
        recommendations=recs,
        notes=notes,
    )


@dataclass(frozen=True)
class MemoryFit:
    """What a precision config needs per rank, against the device's memory."""

    need_bytes: float
    budget_bytes: float | None
    """What one process may use on the device; None where it cannot be told."""
    budget: str
    """The budget in words (``the NVIDIA H200's 150 GB``)."""
    basis: str
    """How ``need_bytes`` was arrived at, in words."""

    @property
    def fits(self) -> bool:
        return self.budget_bytes is None or self.need_bytes <= self.budget_bytes

    def words(self) -> str:
        where = "the device's memory is unknown" if self.budget_bytes is None else (
            f"{'within' if self.fits else 'more than'} {self.budget}")  # fmt: skip
        if math.isinf(self.need_bytes):
            return f"does not fit: {self.basis}"
        return f"needs {self.need_bytes / GB:.3g} GB per rank ({self.basis}), {where}"


def precision_memory(
    ctx: ProfileContext, components: Components, plan: Plan, batch: Batch, model_for_sizes: GemModel,
    precision: PrecisionConfig,
) -> MemoryFit:
    """The memory one step of the configured run would need with ``precision`` instead (module doc).
    A step that runs out of device memory under it does not fit; any other failure raises."""
    policy = ctx.config.activation.policy.name
    budget = device_memory(ctx.config, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    budget_bytes, budget_words = (None, "unknown") if budget is None else budget
    peak = _peak(activation_bytes(ctx, components, batch, precision=precision, policies=[policy])[policy], precision)
    if isinstance(peak, str):
        return MemoryFit(math.inf, budget_bytes, budget_words, f"one step under this precision ran out of memory: {peak}")
    measured = ctx.measured.peak_memory_bytes if ctx.measured is not None else None
    if measured is not None and ctx.measured is not None and ctx.measured.world_size == ctx.world_size:
        mem = ctx.sections.get("memory")
        known = mem.summary.get("activations", {}).get(policy) if mem is not None else None
        now = known["peak"] if known else _peak(
            activation_bytes(ctx, components, batch, policies=[policy])[policy], ctx.config.precision)  # fmt: skip
        if not isinstance(now, str):
            more = peak - int(now)
            return MemoryFit(measured + more, budget_bytes, budget_words,
                             f"the configured run's measured peak {measured / GB:.3g} GB, {'+' if more >= 0 else '-'} "
                             f"{abs(more) / GB:.3g} GB of one step's activation peak under this precision")  # fmt: skip
    fixed = static_bytes(ctx.config, model_for_sizes, plan)
    base = fixed["parameters"] + fixed["gradients"] + fixed["optimizer"]
    return MemoryFit(base + peak, budget_bytes, budget_words,
                     f"parameters, gradients and optimizer state {base / GB:.3g} GB + one step's activation peak "
                     f"{peak / GB:.3g} GB under this precision")  # fmt: skip


def _peak(value: tuple[int, int] | str, precision: PrecisionConfig) -> int | str:
    """The step's peak bytes; the error where it ran out of memory; raises for any other failure."""
    if isinstance(value, str):
        if value.startswith("OutOfMemoryError"):
            return value
        raise RuntimeError(f"one step under precision {precision.model_dump(mode='json')} could not run: {value}")
    return value[1]
