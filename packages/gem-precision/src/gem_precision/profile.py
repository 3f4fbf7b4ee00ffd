"""gem-precision's part of ``gem-train profile``: the ``precision`` subcommand (the sensitivity
probe of :mod:`gem_precision.probe`, with its table and ``precision:`` block) and the ``numerics``
section of the full report (the same probe, summarised, with its recommendation)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gem_model.api import (
    GEMM_BITS,
    GemPluginManager,
    ProfileCommand,
    ProfileContext,
    ProfileSection,
    ProfileTable,
    Recommendation,
)
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
    prec.add_argument("--out-yaml", type=Path, help="write the recommended precision: block here")
    prec.add_argument("--out-json", type=Path, help="write every measurement here")


def run(args: argparse.Namespace, pm: GemPluginManager) -> int:
    """Print the per-module table and the recommended ``precision:`` block."""
    from gem_model.api import load_config

    config = load_config(args.config, args.overrides)
    order = _names(args.order)
    for name in order or ():  # a misspelt name would silently drop out of the ranking
        pm.precision_schemes.get(name)
    options = ProbeOptions(
        batches=args.batches, max_samples=args.max_samples, schemes=_names(args.schemes), order=order or DEFAULT_ORDER,
        max_rel_err=args.max_rel_err, max_loss_change=args.max_loss_change,
    )  # fmt: skip
    result = probe_precision(config, pm, options)
    print(result.table())
    print()
    print(result.yaml(), end="")
    if args.out_yaml is not None:
        args.out_yaml.write_text(result.yaml())
    if args.out_json is not None:
        args.out_json.write_text(json.dumps(result.to_json(), indent=1))
    return 0


COMMAND = ProfileCommand(
    name="precision",
    help="per dense linear: output error and loss change under each precision scheme; recommends a scheme map",
    add_arguments=add_arguments,
    run=run,
)


def pays_on(pm: GemPluginManager, name: str, device: Any) -> bool:
    """Whether scheme ``name``'s fewer GEMM bits can be faster on ``device``: only a GPU's tensor cores
    run them faster, and only a scheme whose GEMMs run natively there (not emulated: an MX scheme on a
    device without MX GEMMs quantizes and then multiplies in bfloat16, which is slower)."""
    if device is None or device.type != "cuda":
        return False
    cls = pm.precision_schemes.get(name).cls
    scheme = cls(cls.Config())
    resolve = getattr(scheme, "resolved_backend", None)
    try:
        return resolve is None or resolve(device) == "native"
    except (RuntimeError, ValueError):
        return False


def lower_bit_share(
    result: ProbeResult, pm: GemPluginManager, configured: str, device: Any = None
) -> tuple[float, float]:
    """(share of the probed linears' weights whose recommendation runs GEMMs in fewer bits than the
    configured scheme and pays on ``device`` (:func:`pays_on`), the mean fraction of their GEMM time
    that saves at the datasheet rates)."""
    bits = {n: GEMM_BITS[pm.precision_schemes.get(n).cls.gemm_dtype] for n in result.schemes}
    now = GEMM_BITS[pm.precision_schemes.get(configured).cls.gemm_dtype]
    total = sum(m.in_features * m.out_features for m in result.modules) or 1
    paying = {n for n in result.schemes if pays_on(pm, n, device)}
    faster = [m for m in result.modules if m.recommended in paying and bits[m.recommended] < now]
    share = sum(m.in_features * m.out_features for m in faster) / total
    saving = [1.0 - bits[m.recommended] / now for m in faster]  # type: ignore[index]
    return share, (sum(saving) / len(saving) if saving else 0.0)


def numerics_section(ctx: ProfileContext) -> ProfileSection:
    options = ProbeOptions(batches=min(ctx.batches, SECTION_BATCHES), max_samples=SECTION_SAMPLES, loss_until_pass=True)
    def phase(what: str) -> None:  # where the section's time goes, in the profile's log
        print(f"[profile] numerics: {what}", file=sys.stderr, flush=True)

    result = probe_precision(ctx.config, ctx.plugins, options, model=ctx.model(), on_phase=phase)
    samples = min(SECTION_SAMPLES, ctx.config.data.global_batch_size)
    rows: list[list[Any]] = []
    for m in result.modules:
        errs = [None if m.measures[s].error else m.measures[s].rel_err for s in result.schemes]
        rows.append([m.fqn, f"{m.in_features}x{m.out_features}", *errs, m.recommended or "fp32 (exclude)"])
    configured = ctx.config.precision.scheme.name
    share, saving = lower_bit_share(result, ctx.plugins, configured, ctx.device)
    recs = []
    if share > 0:
        recs.append(Recommendation(
            action="the probe's precision map (gem-train profile precision --out-yaml precision.yaml)",
            expected_gain=share * saving, metric="GEMM time",
            evidence=f"{100 * share:.0f} % of the linears' weights pass in fewer GEMM bits than {configured} "
            f"(saving {100 * saving:.0f} % of their GEMM time at datasheet rates) "
            f"(rel err <= {result.options.max_rel_err:g}, |dloss|/loss <= {result.options.max_loss_change:g})",
        ))  # fmt: skip
    return ProfileSection(
        name="numerics",
        title=f"numerics: relative output error per linear and scheme ({result.batches} batch(es) of {samples} samples)",
        summary={"baseline_loss": result.baseline_loss, "schemes": result.schemes,
                 "recommended": result.recommendations(), "precision_yaml": result.yaml(),
                 "lower_bit_share": share},
        tables=[ProfileTable("relative error ||y - y_ref|| / ||y_ref||", ["module", "in x out", *result.schemes, "recommended"],
                      rows)],
        recommendations=recs,
        notes=["forward numerics of the freshly initialised model; the backward and training dynamics are not seen",
               f"a map is recommended for speed only where its fewer GEMM bits run natively on {ctx.device.type} "
               "(tensor cores; not emulated)",
               "the loss change is measured where it decides: per linear, the cheapest schemes within the relative "
               "error up to the first that passes (`gem-train profile precision` measures every one)"],
    )
