"""``gem-train profile <what>``: workload profiles. Plugin packages add their profilers here later."""

from __future__ import annotations

import argparse


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="profile the workload (e.g. data shape)")
    kinds = p.add_subparsers(dest="profile_kind", required=True)
    data = kinds.add_parser("data", help="sequence lengths, tokens and padding waste of the configured data")
    data.add_argument("-c", "--config")
    data.add_argument("overrides", nargs="*", metavar="key.sub=value")
    data.add_argument("--batches", type=int, default=20)
    data.set_defaults(profile_handler=profile_data)


def profile_data(args: argparse.Namespace) -> int:
    """Print the shape of the workload: Meta's lesson is to look at it before picking a recipe."""
    import torch

    from gem_model.config_io import load_config
    from gem_model.plugins import GemPluginManager
    from gem_model.registry import Registry

    config = load_config(args.config, args.overrides)
    pm = GemPluginManager()
    sources: Registry = pm.data_sources
    entry = sources.get(config.data.source.name)
    source = entry.cls(entry.cls.Config.model_validate(config.data.source.options))
    b = config.data.global_batch_size
    lengths = torch.cat([source.lengths(step, b) for step in range(args.batches)]).double()
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
