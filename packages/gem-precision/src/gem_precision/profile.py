"""gem-precision's part of ``gem-train profile``: the ``numerics`` section of the full report and the
``precision`` subcommand. Both run the sensitivity probe (:mod:`gem_precision.probe`) with the
device's measured rates ranking each linear's candidates (:mod:`gem_precision.pays`), check the
recommended block against the device's memory, and say why every other scheme was not taken."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from gem_model.api import (
    GemPluginManager,
    ProfileCommand,
    ProfileContext,
    ProfileSection,
    ProfileTable,
    Recommendation,
    RunConfig,
    resolve_components,
)
from gem_precision.gemm_rates import AS_IS, MAX_ROWS, Measure, measure_rates
from gem_precision.pays import MIN_SPEEDUP, Decision, SpeedRanker, decide
from gem_precision.precision_map import recommended_precision
from gem_precision.probe import DEFAULT_ORDER, ProbeOptions, ProbeResult, probe_precision

SECTION_BATCHES = 1  # the probe keeps one batch's linear inputs and outputs: GBs at d=1024
# ... and of that batch a sample: the relative errors are per row, and at ~220k tokens a global batch
# made the section the slowest of the profile by far (minutes: a forward per module and scheme)
SECTION_SAMPLES = 32


def _names(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(n.strip() for n in value.split(",") if n.strip())


def add_arguments(prec: argparse.ArgumentParser) -> None:
    prec.add_argument("-c", "--config")
    prec.add_argument("overrides", nargs="*", metavar="key.sub=value")
    prec.add_argument("--batches", type=int, default=4, help="batches of the configured data (from step 0)")
    prec.add_argument("--max-samples", type=int, help="samples of each batch (default: data.global_batch_size)")
    prec.add_argument("--schemes", help="comma-separated candidates (default: every registered scheme)")
    prec.add_argument("--order", help=f"comma-separated schemes, cheapest first (default: {','.join(DEFAULT_ORDER)})")
    prec.add_argument("--max-rel-err", type=float, default=0.1, help="largest accepted relative output error")
    prec.add_argument("--max-loss-change", type=float, default=0.005, help="largest accepted |dloss|/loss")
    prec.add_argument("--by", choices=("speed", "bits"), default="speed",
                      help="speed: per linear the scheme measured fastest on this device among those that pass, "
                      "checked against its memory (default); bits: the first that passes in --order, whatever "
                      "the device (what each linear tolerates)")  # fmt: skip
    prec.add_argument("--out-yaml", type=Path, help="write the recommended precision: block here")
    prec.add_argument("--out-json", type=Path, help="write every measurement here")


def run(args: argparse.Namespace, pm: GemPluginManager) -> int:
    """Print the per-module table and the recommended ``precision:`` block (and, by speed, the rates)."""
    from gem_model.api import load_config, profile_context

    config = load_config(args.config, args.overrides)
    order = _names(args.order)
    for name in order or ():  # a misspelt name would silently drop out of the ranking
        pm.precision_schemes.get(name)
    options = ProbeOptions(
        batches=args.batches, max_samples=args.max_samples, schemes=_names(args.schemes), order=order or DEFAULT_ORDER,
        max_rel_err=args.max_rel_err, max_loss_change=args.max_loss_change,
    )  # fmt: skip
    if args.by == "bits":
        result = probe_precision(config, pm, options)
        data = result.to_json()
        text, block = result.table(), result.yaml()
    else:
        options.check()
        ctx = profile_context(config, pm)
        samples = min(config.data.global_batch_size, options.max_samples or config.data.global_batch_size)
        result, ranker, decision = recommend(ctx, options, samples)
        section = _section(ctx, result, ranker, decision, samples)
        data = {**result.to_json(), **{k: v for k, v in section.summary.items() if k != "precision_yaml"}}
        text = "\n\n".join([result.table(), *(_plain(t) for t in section.tables[1:]), *section.notes[1:]])
        block = _yaml(result, decision)
    print(text)
    print()
    print(block, end="")
    if args.out_yaml is not None:
        args.out_yaml.write_text(block)
    if args.out_json is not None:
        args.out_json.write_text(json.dumps(data, indent=1))
    return 0


COMMAND = ProfileCommand(
    name="precision",
    help="per dense linear: output error and loss change under each precision scheme, the device's measured rates; "
    "recommends a scheme map that pays on this device and fits its memory",
    add_arguments=add_arguments,
    run=run,
)


def activation_dtype(config: RunConfig, pm: GemPluginManager) -> torch.dtype:
    """The dtype the run's linears get their inputs in (``precision.activation_dtype``, auto: the scheme's)."""
    name = config.precision.activation_dtype
    if name == "auto":
        name = pm.precision_schemes.get(config.precision.scheme.name).cls.activation_dtype
    return getattr(torch, name)


def recommend(
    ctx: ProfileContext, options: ProbeOptions, samples: int, *, measure: Measure = measure_rates,
    on_phase: Any = None,
) -> tuple[ProbeResult, SpeedRanker, Decision]:
    """The probe ranked by the rates ``measure`` gives on ``ctx.device``, and the decision, memory
    checked through ``ctx.memory_fit`` where the context can (``ctx.fit_memory``)."""
    config = ctx.config
    rank_samples = config.data.global_batch_size / max(ctx.dp_degree, 1)
    configured = resolve_components(config, ctx.plugins).precision
    ranker = SpeedRanker(ctx.device, activation_dtype(config, ctx.plugins), rank_samples / samples, measure, configured)
    result = probe_precision(config, ctx.plugins, options, model=ctx.model(), on_phase=on_phase, rank=ranker)
    fit = ctx.memory_fit if ctx.fit_memory is not None else None
    decision = decide(result, ranker, config.precision, fit)
    for m in result.modules:  # the probe's table and block then show the decision
        m.recommended = decision.recommended[m.fqn]
    result.precision = decision.precision or recommended_precision(decision.recommended, result.schemes, config.precision)
    return result, ranker, decision


def numerics_section(ctx: ProfileContext, *, measure: Measure = measure_rates) -> ProfileSection:
    """The ``numerics`` section; ``measure`` times the schemes (a stand-in in tests)."""
    options = ProbeOptions(batches=min(ctx.batches, SECTION_BATCHES), max_samples=SECTION_SAMPLES, loss_until_pass=True)

    def phase(what: str) -> None:  # where the section's time goes, in the profile's log
        print(f"[profile] numerics: {what}", file=sys.stderr, flush=True)

    samples = min(SECTION_SAMPLES, ctx.config.data.global_batch_size)
    result, ranker, decision = recommend(ctx, options, samples, measure=measure, on_phase=phase)
    return _section(ctx, result, ranker, decision, samples)


def _step_seconds(ctx: ProfileContext) -> float | None:
    m = ctx.measured
    if m is None:
        return None
    steps = m.unprofiled_step_seconds or m.step_seconds
    return sum(steps) / len(steps) if steps else None


def _yaml(result: ProbeResult, decision: Decision) -> str:
    if decision.precision is None:
        return "# gem-train profile precision: nothing to change on this device; the config's precision stays\n"
    return result.yaml()


def _gain(saving: float, step: float | None, linears: float) -> str:
    if step:
        return f"{1e3 * saving:+.2f} ms/step ({100 * saving / step:+.1f} % of the step)"
    return f"{1e3 * saving:+.2f} ms/step ({100 * saving / linears if linears else 0.0:+.1f} % of the linears' time)"


def _section(
    ctx: ProfileContext, result: ProbeResult, ranker: SpeedRanker, decision: Decision, samples: int
) -> ProfileSection:
    step = _step_seconds(ctx)
    saving = decision.seconds_now - decision.seconds_after
    fit = decision.fit
    if fit is not None:
        memory_note = f"memory of the {'recommended' if decision.precision else 'last checked'} map: {fit.words()}"
    elif decision.not_made:
        memory_note = "memory: the map was not recommended (below)"
    elif ctx.fit_memory is not None:
        memory_note = "memory: nothing to check (no change recommended)"
    else:
        memory_note = "memory: not checked (this profile context has no memory_fit)"
    summary = {
        "baseline_loss": result.baseline_loss, "schemes": result.schemes, "recommended": decision.recommended,
        "current": ranker.current, "why_not": {f: {s: {"kind": w.kind, "text": w.text} for s, w in mine.items()}
                                               for f, mine in decision.why.items()},
        "rates": ranker.table.to_json(), "rows_per_step": {f: shape.rows for f, shape in ranker.shapes.items()},
        "linears_s_per_step": {"now": decision.seconds_now, "recommended": decision.seconds_after},
        "step_s": step, "expected_step_gain": saving / step if step else None, "not_made": decision.not_made,
        "memory": None if fit is None else {"need_bytes": fit.need_bytes if math.isfinite(fit.need_bytes) else None,
                                            "budget_bytes": fit.budget_bytes,
                                            "fits": fit.fits, "words": fit.words()},
    }  # fmt: skip
    rates, summary["scheme_gain_s_per_step"] = _rates_table(result, ranker, decision, step)
    if decision.precision is not None:
        summary["precision_yaml"] = _yaml(result, decision)
    notes = [
        "forward numerics of the freshly initialised model; the backward and training dynamics are not seen",
        "a scheme is recommended for a linear only where that linear (its GEMMs and its quantization) is measured "
        f"at least {MIN_SPEEDUP:g}x faster on this device than under the config's scheme, never through an emulated "
        "backend, and only where the whole map fits the device's memory",
        "each linear is timed quantizing its own input; where a producer kernel writes the fp8 rows instead "
        "(gem_model.api.PrequantizedRows: the fused HSTU block under fp8_rowwise) a run pays less, between the "
        "GEMM-only and the with-quantization rate, so a scheme measured slower there may still pay",
        memory_note, *decision.not_made,
        "the loss change is measured where it decides: per linear, in the order its recommendation is picked "
        "(`gem-train profile precision --by bits` measures every one)",
    ]
    return ProfileSection(
        name="numerics",
        title=f"numerics: relative output error per linear and scheme ({result.batches} batch(es) of {samples} "
        f"samples), and what each scheme's linears cost on {ranker.table.device}",
        summary=summary, tables=[_errors_table(result, ranker, decision), rates],
        recommendations=_recommendation(result, ranker, decision, step), notes=notes,
    )


def _errors_table(result: ProbeResult, ranker: SpeedRanker, decision: Decision) -> ProfileTable:
    rows = []
    for m in result.modules:
        errs = [None if m.measures[s].error else m.measures[s].rel_err for s in result.schemes]
        rec = decision.recommended[m.fqn]
        rows.append([m.fqn, f"{m.in_features}x{m.out_features}", *errs, m.current or "fp32 (as is)",
                     rec or "fp32 (exclude)", decision.why_not(m.fqn, ranker.bits)])  # fmt: skip
    columns = ["module", "in x out", *result.schemes, "config", "recommended", "why not fewer GEMM bits"]
    return ProfileTable("relative error ||y - y_ref|| / ||y_ref||", columns, rows)


def _rates_table(
    result: ProbeResult, ranker: SpeedRanker, decision: Decision, step: float | None
) -> tuple[ProfileTable, dict[str, float]]:
    """Per scheme: backend, rates, and what the step would gain if every linear took it."""
    table = ranker.table
    names = [n for n in result.schemes if n in table.backends] + [n for n in table.backends if n not in result.schemes]
    rows, gains = [], {}
    for name in names:
        b = table.backends[name]
        gains[name] = ranker.gain_if_all(None if name == AS_IS else name)
        share = table.quantization_share(name)
        rows.append([name, b.name, b.error or b.why, table.tflops(name, gemm_only=True), table.tflops(name),
                     None if share is None else f"{100 * share:.0f} %", _gain(gains[name], step, decision.seconds_now),
                     decision.scheme_summary(name) if name in result.schemes else "-"])  # fmt: skip
    dtype = str(ranker.dtype).removeprefix("torch.")
    title = (f"measured on {table.device}: each linear's forward and backward at the rows a step gives it ({dtype} "
             f"inputs, at most {MAX_ROWS:,} rows timed)")  # fmt: skip
    columns = ["scheme", "backend", "why this backend", "GEMM TFLOP/s", "TFLOP/s with quantization",
               "time outside the GEMMs", "gain if every linear took it", "recommended"]  # fmt: skip
    return ProfileTable(title, columns, rows), gains


def _recommendation(
    result: ProbeResult, ranker: SpeedRanker, decision: Decision, step: float | None
) -> list[Recommendation]:
    saving = decision.seconds_now - decision.seconds_after
    if decision.precision is None or saving <= 0:
        return []
    changed = sum(1 for f, r in decision.recommended.items() if r != ranker.current[f])
    fit = "" if decision.fit is None else f"; memory: {decision.fit.words()}"
    opts = result.options
    return [Recommendation(
        action="the numerics section's precision map (its precision_yaml; `gem-train tune --profile DIR` measures it)",
        expected_gain=saving / step if step else saving / decision.seconds_now,
        metric="step time" if step else "the linears' time",
        evidence=f"{changed} of {len(decision.recommended)} linears measured faster on {ranker.table.device} and within "
        f"the numerics (rel err <= {opts.max_rel_err:g}, |dloss|/loss <= {opts.max_loss_change:g}): the linears take "
        f"{1e3 * decision.seconds_after:.1f} instead of {1e3 * decision.seconds_now:.1f} ms a step{fit}",
    )]  # fmt: skip


def _plain(t: ProfileTable) -> str:
    """A table as aligned text (the subcommand prints without the report's renderer)."""
    cells = [[_cell(v) for v in row] for row in [t.columns, *t.rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(t.columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join([t.title, lines[0], "-" * len(lines[0]), *lines[1:]])


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3g}" if isinstance(v, float) else str(v)
