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
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import yaml
from torch import nn

from gem_model.api import (
    Batch,
    ConfigError,
    GemModel,
    GemPluginManager,
    KernelUnavailableError,
    PrecisionConfig,
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

# cheapest first; schemes missing from the order are tried after these, in registry order
DEFAULT_ORDER: tuple[str, ...] = ("mxfp8", "fp8_rowwise", "fp8_tensorwise", "bf16", "fp32")


@dataclass(frozen=True)
class ProbeOptions:
    batches: int = 4
    schemes: tuple[str, ...] | None = None
    """Candidate scheme names; None: every registered scheme."""
    order: tuple[str, ...] = DEFAULT_ORDER
    max_rel_err: float = 0.1
    max_loss_change: float = 0.005
    """Largest accepted ``|Δloss| / loss`` when only the module is converted."""
    max_samples: int | None = None
    """Samples per batch (None: ``data.global_batch_size``). The probe keeps every linear's input and
    output of a batch and recomputes the loss per (module, scheme): at ~220k tokens a batch that is
    tens of GB and minutes, so the profile's section reads a sample of the batch."""
    loss_until_pass: bool = False
    """Recompute the loss only where it decides the recommendation: per module, the schemes in
    ``order`` whose relative error passes, up to the first that passes both tests. The others get
    ``loss_delta`` NaN (not measured). False: every (module, scheme), for the full table."""

    def check(self) -> None:
        problems: list[tuple[str, object, str]] = []
        if self.batches < 1:
            problems.append(("--batches", self.batches, "must be at least 1"))
        if self.max_samples is not None and self.max_samples < 1:
            problems.append(("--max-samples", self.max_samples, "must be at least 1"))
        if self.schemes is not None and not self.schemes:
            problems.append(("--schemes", self.schemes, "name at least one scheme"))
        for flag, value in (("--max-rel-err", self.max_rel_err), ("--max-loss-change", self.max_loss_change)):
            if not value >= 0.0:  # also rejects NaN
                problems.append((flag, value, "must be a number >= 0"))
        if problems:
            raise ConfigError(problems)


@dataclass
class SchemeMeasure:
    """One scheme on one module."""

    rel_err: float
    sqnr_db: float
    """``10 log10(||y_ref||² / ||y - y_ref||²)``; inf when the output is exact."""
    loss_delta: float
    """Mean loss over the batches with only this module converted, minus the float32 loss."""
    error: str | None = None
    """Why the scheme could not convert or run this module (then it is never recommended)."""

    def passes(self, options: ProbeOptions, baseline_loss: float) -> bool:
        if self.error is not None:
            return False
        loss_change = abs(self.loss_delta) / max(abs(baseline_loss), 1e-12)
        return self.rel_err <= options.max_rel_err and loss_change <= options.max_loss_change


@dataclass
class ModuleReport:
    fqn: str
    in_features: int
    out_features: int
    measures: dict[str, SchemeMeasure]
    recommended: str | None = None
    """The first passing scheme of ``order``; None: none passed, the module stays float32 (``exclude``)."""
    rows: int = 0
    """Rows of its input per probed batch (tokens for a block's linears, samples for the towers')."""
    current: str | None = None
    """The scheme the probed config gives it (None: left as is, float32 inside)."""
    order: list[str] = field(default_factory=list)
    """The candidates in the order its recommendation was picked in (``options.order``, or the ranker's)."""


@dataclass(frozen=True)
class ProbedLinear:
    """What a :data:`Ranker` is told of one linear."""

    fqn: str
    in_features: int
    out_features: int
    rows: int
    """Rows of its input per probed batch."""
    current: str | None
    """The config's scheme for it (None: left as is)."""


Ranker = Callable[[list["ProbedLinear"], dict[str, PrecisionScheme]], dict[str, list[str]]]
"""Given every probed linear and the candidate schemes (cheapest first by ``options.order``), per
linear the candidates its recommendation is picked from, in order: the first that passes the
thresholds. A candidate its list leaves out is measured but never recommended for it; a linear left
out of the answer picks in ``options.order``. :class:`gem_precision.pays.SpeedRanker` ranks by the
time each scheme's linear takes on the device."""


@dataclass
class ProbeResult:
    config_name: str
    batches: int
    baseline_loss: float
    schemes: list[str]
    """Candidates, cheapest first (the order recommendations are picked in)."""
    options: ProbeOptions
    modules: list[ModuleReport]
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """The recommended ``precision`` section."""
    samples: int = 0
    """Samples of each probed batch."""

    def recommendations(self) -> dict[str, str | None]:
        return {m.fqn: m.recommended for m in self.modules}

    def yaml(self) -> str:
        """The recommended ``precision:`` block, loadable by :func:`gem_model.config_io.load_config`."""
        section = self.precision.model_dump(mode="json")
        if not section["scheme"]["options"]:
            section["scheme"] = section["scheme"]["name"]
        head = (
            f"# gem-train profile precision: {self.config_name}, {self.batches} batch(es), "
            f"rel err <= {self.options.max_rel_err:g}, |dloss|/loss <= {self.options.max_loss_change:g}\n"
        )
        return head + yaml.safe_dump({"precision": section}, sort_keys=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["precision"] = self.precision.model_dump(mode="json")
        # strict JSON has no Infinity or NaN: null means exact (SQNR) or not measured (an error)
        for module in data["modules"]:
            for measure in module["measures"].values():
                for key in ("rel_err", "sqnr_db", "loss_delta"):
                    if not math.isfinite(measure[key]):
                        measure[key] = None
        return data

    def table(self) -> str:
        opts = self.options
        lines = [
            f"precision probe of {self.config_name!r}: {self.batches} batch(es), float32 loss {self.baseline_loss:.4f}",
            f"cells: rel err, SQNR dB, dloss/loss with only that module converted; '*' = over a threshold "
            f"(rel err {opts.max_rel_err:g}, |dloss|/loss {opts.max_loss_change:g})",
        ]
        name_w = max([len("module"), *(len(m.fqn) for m in self.modules)])
        cell_w = 21
        header = f"{'module':<{name_w}}  {'in x out':>9}  " + "".join(f"{s:<{cell_w}}" for s in self.schemes)
        lines += ["", header + "recommended", "-" * (len(header) + 11)]
        for m in self.modules:
            cells = "".join(f"{_cell(m.measures[s], opts, self.baseline_loss):<{cell_w}}" for s in self.schemes)
            shape = f"{m.in_features}x{m.out_features}"
            lines.append(f"{m.fqn:<{name_w}}  {shape:>9}  {cells}{m.recommended or 'fp32 (exclude)'}")
        counts = Counter(m.recommended or "exclude" for m in self.modules)
        lines += ["", "recommended: " + ", ".join(f"{n} x{c}" for n, c in counts.most_common())]
        return "\n".join(lines)


def _cell(m: SchemeMeasure, options: ProbeOptions, baseline: float) -> str:
    if m.error is not None:
        return "error"
    sqnr = "inf" if math.isinf(m.sqnr_db) else f"{m.sqnr_db:.1f}"
    mark = "" if m.passes(options, baseline) else "*"
    return f"{m.rel_err:.1e} {sqnr:>4} {m.loss_delta / max(abs(baseline), 1e-12):+.2%}{mark}"


# --------------------------------------------------------------------------------------- the probe


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
    for kernel, path in ((components.attention, "jagged_attention"), (components.norm_gate, "norm_gate")):
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
            seed=config.trainer.seed,
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
