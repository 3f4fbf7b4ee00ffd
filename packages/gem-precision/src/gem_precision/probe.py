"""Precision sensitivity probe: how much each dense linear suffers under each precision scheme.

For a run config and a few batches of its data, per linear that :func:`precision_plan` considers:

1. its float32 input and output are captured (forward hooks on the unconverted model);
2. for each candidate scheme, ``scheme.convert_linear(copy.deepcopy(linear), fqn)`` is run on the
   captured inputs: relative error ``||y - y_ref|| / ||y_ref||`` and SQNR (dB) over all batches;
3. the model loss is recomputed with only that module converted (the rest float32), on the same
   batches: the change in loss says what the error costs downstream (a linear before a sharp
   softmax can matter more than its relative error suggests).

The recommendation per module is the cheapest scheme (``order``) whose relative error and
``|Δloss| / loss`` stay under the thresholds; it is emitted as a ``precision:`` block that
``gem-train run -c`` accepts as is. The probe knows schemes only through the registry and
:class:`PrecisionScheme`, so it measures whatever schemes are installed (gem-precision's and any
other package's). ``gem-train profile precision`` runs it (:mod:`gem_precision.profile`), and the
``numerics`` section of ``gem-train profile`` is its summary.

What it does not see: the backward pass (gradient quantization) and training dynamics. It measures
forward numerics of the model as built from the config (fresh initialisation, ``trainer.seed``).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gem_model.api import (
    Batch,
    GemModel,
    GemPluginManager,
    KernelUnavailableError,
    PrecisionScheme,
    RunConfig,
    ShardedLoader,
    pick_device,
    precision_plan,
    resolve_components,
    set_submodule,
    step_loss,
)
from gem_precision.precision_map import recommended_precision
from gem_precision.probe_result import (
    DEFAULT_ORDER,
    ModuleReport,
    ProbedLinear,
    ProbeOptions,
    ProbeResult,
    Ranker,
    SchemeMeasure,
)

__all__ = [  # the options and the result types live in probe_result; importable from here too
    "DEFAULT_ORDER", "ModuleReport", "ProbeOptions", "ProbeResult", "ProbedLinear", "Ranker", "SchemeMeasure",
    "model_loss", "probe_precision",
]  # fmt: skip


def probe_precision(
    config: RunConfig, pm: GemPluginManager, options: ProbeOptions | None = None, *, model: GemModel | None = None,
    on_phase: Callable[[str], None] | None = None, rank: Ranker | None = None,
) -> ProbeResult:
    """Measure every dense linear of ``config``'s model under every candidate scheme; recommend a map.

    ``rank``: orders each linear's candidates once the errors are measured (before the losses, which
    ``loss_until_pass`` measures in that order); None: ``options.order`` for every linear.

    ``model``: the config's float32 model already built on the device (the profile's shared one,
    :meth:`ProfileContext.model <gem_model.profiling.context.ProfileContext.model>`), so its tables are
    not drawn again; it is evaluated in eval mode and left as it was. None: the probe builds its own.
    ``on_phase``: told, as each phase ends, what it did and how long it took (the profile prints it).
    """
    options = options or ProbeOptions()
    options.check()
    components = resolve_components(config, pm)  # same names and option checks as `gem-train run`
    schemes = _candidate_schemes(pm, components.precision, options)
    device = pick_device(config.trainer.device, 0)
    kernels = ((components.attention, "jagged_attention"), (components.norm_gate, "norm_gate"),
               (components.next_item_loss, "next_item_loss"))  # fmt: skip
    for kernel, path in kernels:
        try:
            kernel.check_available(device)
        except KernelUnavailableError as exc:
            raise KernelUnavailableError(f"kernels.{path}: {kernel.name!r} cannot run here: {exc}") from None
    torch.manual_seed(config.trainer.seed * 1_000)  # as rank 0 of a run: the same initial model
    samples = min(config.data.global_batch_size, options.max_samples or config.data.global_batch_size)
    loader = ShardedLoader(components.source, components.balancer, global_batch_size=samples)
    if model is None:
        model = GemModel(
            config.model, loader.spec, attention=components.attention, norm_gate=components.norm_gate,
            next_item_loss=components.next_item_loss, sequence_pool=components.sequence_pool,
            sequence_input=components.sequence_input, seed=config.trainer.seed,
        )  # fmt: skip
        if model.tables_on_meta:  # model.table_init: device (a planner would draw them; here the probe does)
            model.materialize_tables(device)
        model.to(device)
    was_training = model.training
    model.eval()  # no dropout: every forward of a batch sees the same noise-free activations
    batches = [loader.batch_at(step).to(device) for step in range(options.batches)]
    plan = precision_plan(model, config.precision)
    try:
        with torch.no_grad():
            baseline, modules = _measure(model, batches, plan, schemes, options, on_phase or (lambda _: None), rank)
    finally:
        model.train(was_training)
    result = ProbeResult(config.name, options.batches, baseline, list(schemes), options, modules, samples=samples)
    for module in modules:
        module.recommended = next((s for s in module.order if module.measures[s].passes(options, baseline)), None)
    result.precision = recommended_precision(result.recommendations(), list(schemes), config.precision)
    return result


def _candidate_schemes(
    pm: GemPluginManager, configured: dict[str, PrecisionScheme], options: ProbeOptions
) -> dict[str, PrecisionScheme]:
    """Candidate instances, cheapest first. A scheme the config names keeps its configured options."""
    names = list(options.schemes) if options.schemes is not None else pm.precision_schemes.names()
    for name in names:
        pm.precision_schemes.get(name)  # an unknown name raises the registry's "unknown name" error
    ordered = [n for n in options.order if n in names] + [n for n in names if n not in options.order]
    out: dict[str, PrecisionScheme] = {}
    for name in ordered:
        if name in configured:
            out[name] = configured[name]
        else:
            cls = pm.precision_schemes.get(name).cls
            out[name] = cls(cls.Config())
    return out


def model_loss(model: GemModel, batch: Batch) -> float:
    """The trainer's loss of one batch on one process (:func:`gem_model.profiling.memory.step_loss`)."""
    return float(step_loss(model, batch).detach())


def _capture(
    model: GemModel, fqns: list[str], batch: Batch
) -> tuple[float, dict[str, list[tuple[torch.Tensor, torch.Tensor]]]]:
    """One float32 forward: the loss, and every call's (input, output) of each linear in ``fqns``."""
    seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {f: [] for f in fqns}
    handles = []
    for fqn in fqns:

        def hook(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor, fqn: str = fqn) -> None:
            seen[fqn].append((args[0].detach().clone(), output.detach().float().clone()))

        handles.append(model.get_submodule(fqn).register_forward_hook(hook))
    try:
        loss = model_loss(model, batch)
    finally:
        for h in handles:
            h.remove()
    return loss, seen


def _measure(
    model: GemModel, batches: list[Batch], plan: dict[str, str | None], schemes: dict[str, PrecisionScheme],
    options: ProbeOptions, on_phase: Callable[[str], None], rank: Ranker | None,
) -> tuple[float, list[ModuleReport]]:
    fqns = list(plan)
    # squared norms summed over batches, so the error is that of all captured outputs together
    err2 = {(f, s): 0.0 for f in fqns for s in schemes}
    ref2 = dict.fromkeys(fqns, 0.0)
    rows = dict.fromkeys(fqns, 0)
    errors: dict[tuple[str, str], str] = {}
    converted: dict[tuple[str, str], nn.Module] = {}
    exact: set[tuple[str, str]] = set()
    losses: list[float] = []
    clock = time.perf_counter()
    for batch in batches:
        loss, seen = _capture(model, fqns, batch)  # one batch's activations alive at a time
        losses.append(loss)
        on_phase(f"float32 forward with {len(fqns)} linears captured: {time.perf_counter() - clock:.1f} s")
        clock = time.perf_counter()
        for fqn in fqns:
            linear = model.get_submodule(fqn)
            for name, scheme in schemes.items():
                key = (fqn, name)
                if key in errors or key in exact:
                    continue
                try:
                    if key not in converted:
                        copy_ = copy.deepcopy(linear)
                        converted[key] = scheme.convert_linear(copy_, fqn)
                        if converted[key] is copy_:  # the scheme keeps the linear: exact by definition
                            exact.add(key)
                            continue
                    for x, y_ref in seen[fqn]:
                        err2[key] += float((converted[key](x).float() - y_ref).double().square().sum())
                except (RuntimeError, ValueError, TypeError) as exc:
                    errors[key] = f"{type(exc).__name__}: {exc}"
            ref2[fqn] += sum(float(y.double().square().sum()) for _, y in seen[fqn])
            rows[fqn] += sum(x.numel() // x.shape[-1] for x, _ in seen[fqn])
        on_phase(f"{len(fqns)} linears x {len(schemes)} schemes converted and compared: {time.perf_counter() - clock:.1f} s")
        clock = time.perf_counter()
    baseline = sum(losses) / len(losses)
    linears = [ProbedLinear(f, m.in_features, m.out_features, rows[f] // len(batches), plan[f])
               for f, m in ((f, model.get_submodule(f)) for f in fqns)]  # fmt: skip
    ranked = rank(linears, schemes) if rank is not None else {}
    if rank is not None:
        on_phase(f"{len(fqns)} linears ranked: {time.perf_counter() - clock:.1f} s")
        clock = time.perf_counter()
    recomputed = 0
    reports = []
    for fqn in fqns:
        linear = model.get_submodule(fqn)
        order = [s for s in ranked[fqn] if s in schemes] if fqn in ranked else list(schemes)
        measures: dict[str, SchemeMeasure] = {}
        decided = False  # loss_until_pass: an earlier scheme passed, so the rest cannot be recommended
        for name in order + [s for s in schemes if s not in order]:
            key = (fqn, name)
            if key in errors:
                measures[name] = SchemeMeasure(math.nan, math.nan, math.nan, errors[key])
                continue
            if key in exact:
                measures[name] = SchemeMeasure(0.0, math.inf, 0.0)
            else:
                rel = _rel(err2[key], ref2[fqn])
                measures[name] = SchemeMeasure(rel, _sqnr(err2[key], ref2[fqn]), math.nan)
                if options.loss_until_pass and (decided or name not in order or not rel <= options.max_rel_err):
                    continue
                try:
                    measures[name].loss_delta = _loss_with(model, fqn, converted[key], batches) - baseline
                    recomputed += 1
                except (RuntimeError, ValueError, TypeError) as exc:
                    measures[name] = SchemeMeasure(math.nan, math.nan, math.nan, f"{type(exc).__name__}: {exc}")
                    continue
            decided = decided or measures[name].passes(options, baseline)
        measures = {s: measures[s] for s in schemes}  # the table's column order
        reports.append(ModuleReport(fqn, linear.in_features, linear.out_features, measures, None,
                                    rows[fqn] // len(batches), plan[fqn], order))  # fmt: skip
    on_phase(f"{recomputed} losses recomputed with one linear converted: {time.perf_counter() - clock:.1f} s")
    return baseline, reports


def _loss_with(model: GemModel, fqn: str, module: nn.Module, batches: list[Batch]) -> float:
    """Mean loss with ``module`` in place of ``fqn`` (and everything else as it is)."""
    original = model.get_submodule(fqn)
    set_submodule(model, fqn, module)
    try:
        return sum(model_loss(model, b) for b in batches) / len(batches)
    finally:
        set_submodule(model, fqn, original)


def _rel(err2: float, ref2: float) -> float:
    return math.sqrt(err2 / ref2) if ref2 > 0 else (0.0 if err2 == 0 else math.inf)


def _sqnr(err2: float, ref2: float) -> float:
    if err2 == 0:
        return math.inf
    return 10 * math.log10(ref2 / err2) if ref2 > 0 else -math.inf
