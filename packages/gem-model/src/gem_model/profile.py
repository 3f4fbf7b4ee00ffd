"""``gem-train profile <what>``: workload profiles (``data``: the shape of the batches; ``precision``:
per-linear sensitivity to each precision scheme). Plugin packages add their profilers here later."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="profile the workload (e.g. data shape)")
    kinds = p.add_subparsers(dest="profile_kind", required=True)
    data = kinds.add_parser("data", help="sequence lengths, tokens and padding waste of the configured data")
    data.add_argument("-c", "--config")
    data.add_argument("overrides", nargs="*", metavar="key.sub=value")
    data.add_argument("--batches", type=int, default=20)
    data.set_defaults(profile_handler=profile_data)
    prec = kinds.add_parser(
        "precision",
        help="per dense linear: output error and loss change under each precision scheme; recommends a scheme map",
    )
    prec.add_argument("-c", "--config")
    prec.add_argument("overrides", nargs="*", metavar="key.sub=value")
    prec.add_argument("--batches", type=int, default=4, help="batches of the configured data (from step 0)")
    prec.add_argument("--schemes", help="comma-separated candidates (default: every registered scheme)")
    prec.add_argument(
        "--order", help="comma-separated schemes, cheapest first (default: mxfp8,fp8_rowwise,fp8_tensorwise,bf16,fp32)"
    )
    prec.add_argument("--max-rel-err", type=float, default=0.1, help="largest accepted relative output error")
    prec.add_argument("--max-loss-change", type=float, default=0.005, help="largest accepted |dloss|/loss")
    prec.add_argument("--out-yaml", type=Path, help="write the recommended precision: block here")
    prec.add_argument("--out-json", type=Path, help="write every measurement here")
    prec.set_defaults(profile_handler=profile_precision)


def _names(value: str | None) -> tuple[str, ...] | None:
    return None if value is None else tuple(n.strip() for n in value.split(",") if n.strip())


def profile_precision(args: argparse.Namespace) -> int:
    """Print the per-module table and the recommended ``precision:`` block (see :mod:`gem_model.precision_probe`)."""
    from gem_model.config_io import load_config
    from gem_model.plugins import GemPluginManager
    from gem_model.precision_probe import DEFAULT_ORDER, ProbeOptions, probe_precision

    config = load_config(args.config, args.overrides)
    pm = GemPluginManager()
    order = _names(args.order)
    for name in order or ():  # a misspelt name would silently drop out of the ranking
        pm.precision_schemes.get(name)
    options = ProbeOptions(
        batches=args.batches,
        schemes=_names(args.schemes),
        order=order or DEFAULT_ORDER,
        max_rel_err=args.max_rel_err,
        max_loss_change=args.max_loss_change,
    )
    result = probe_precision(config, pm, options)
    print(result.table())
    print()
    print(result.yaml(), end="")
    if args.out_yaml is not None:
        args.out_yaml.write_text(result.yaml())
    if args.out_json is not None:
        args.out_json.write_text(json.dumps(result.to_json(), indent=1))
    return 0


def profile_data(args: argparse.Namespace) -> int:
    """Print the shape of the workload: Meta's lesson is to look at it before picking a recipe."""
    import torch

    from gem_model.config_io import load_config
    from gem_model.plugins import GemPluginManager
    from gem_model.registry import Registry
    from gem_model.train.progress import task_progress

    config = load_config(args.config, args.overrides)
    pm = GemPluginManager()
    sources: Registry = pm.data_sources
    entry = sources.get(config.data.source.name)
    source = entry.cls(entry.cls.Config.model_validate(config.data.source.options))
    b = config.data.global_batch_size
    parts = []
    with task_progress(args.batches, "profile data", unit="batch") as advance:
        for step in range(args.batches):
            parts.append(source.lengths(step, b))
            advance(1)
    lengths = torch.cat(parts).double()
    n = lengths.numel()
    padded = float(lengths.max()) * n
    print(f"{args.batches} global batches of {b} samples from {config.data.source.name!r}")
    for q in (0.5, 0.9, 0.99, 1.0):
        print(f"  length p{int(q * 100):<3} {float(torch.quantile(lengths, q)):8.1f}")
    print(f"  mean length      {float(lengths.mean()):8.1f}")
    print(f"  empty histories  {float((lengths == 0).double().mean()) * 100:7.1f} %")
    print(f"  tokens if padded to the longest: {padded:,.0f}, real: {float(lengths.sum()):,.0f} "
          f"({100 * float(lengths.sum()) / max(padded, 1):.1f} % useful)")
    sq = float((lengths**2).sum())
    print(f"  attention pairs: real {sq:,.0f} vs padded {float(lengths.max()) ** 2 * n:,.0f}")
    return 0
