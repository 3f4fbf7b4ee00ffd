"""The ``gem-train tune`` command line (:mod:`gem_model.tune.search`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console
from rich.table import Table

from gem_model.errors import ConfigError


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="search kernels, precision, activation policy, balancer and planner by short runs")
    p.add_argument("-c", "--config", help="a .yaml/.yml/.toml run config (default: the tiny CPU run)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument("--budget", type=float, required=True, help="minutes the whole search may take")
    p.add_argument("--steps", type=int, default=6, help="training steps per candidate")
    p.add_argument("--memory-gb", type=float, help="largest accepted peak memory per GPU")
    p.add_argument("--max-loss-increase", type=float, default=0.05, help="largest accepted relative loss increase")
    p.add_argument("--profile", type=Path, help="a `gem-train profile` directory (its numerics map is a candidate)")
    p.add_argument("--out", type=Path, help="where tuned.yaml and tune.json go (default: <output_dir>/tune)")
    p.set_defaults(profile_handler=tune_main)


def tune_main(args: argparse.Namespace) -> int:
    from gem_model.config_io import load_config
    from gem_model.plugins import GemPluginManager
    from gem_model.profiling.render import load_report
    from gem_model.tune.search import tune, write_result

    if not args.budget > 0 or args.steps < 2:
        raise ConfigError([("--budget/--steps", (args.budget, args.steps), "a budget > 0 and at least 2 steps")])
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each rank would time and choose on its own
        raise ConfigError([("WORLD_SIZE", os.environ["WORLD_SIZE"], "gem-train tune measures candidates on "
                            "one device: run it in one process (torchrun --nproc-per-node 1 where the "
                            "planner needs a process group)")])  # fmt: skip
    config = load_config(args.config, args.overrides)
    profile = load_report(args.profile) if args.profile is not None else None
    result = tune(config, GemPluginManager(), budget_s=args.budget * 60, steps=args.steps, memory_gb=args.memory_gb,
                  max_loss_increase=args.max_loss_increase, profile=profile)  # fmt: skip
    table = Table(title=f"gem-train tune: {len(result.candidates)} candidate(s) in {result.seconds:.0f} s")
    for col in ("dimension", "change", "tokens/s", "peak GB", "last loss", "s", "chosen / error"):
        table.add_column(col, overflow="fold")
    for c in [result.baseline, *result.candidates]:
        change = ", ".join(f"{k}={v}" for k, v in c.overrides.items()) or "(the config)"
        fmt = [f"{c.tokens_per_s:,.0f}" if c.tokens_per_s else "-", f"{c.peak_memory_gb:.2f}" if c.peak_memory_gb else "-",
               f"{c.last_loss:.4f}" if c.last_loss is not None else "-"]  # fmt: skip
        table.add_row(c.dimension, change, *fmt, f"{c.seconds:.1f}", _short(c.error) if c.error else ("yes" if c.chosen else ""))
    Console().print(table)
    out = args.out or Path(config.trainer.output_dir.format(name=config.name)) / "tune"
    for what, path in write_result(result, out).items():
        print(f"wrote {what}: {path}")
    if result.stopped_by_budget:
        print("stopped by the budget: not every candidate was tried")
    return 0


def _short(error: str, width: int = 90) -> str:
    """The table's cell; tune.json keeps the whole message."""
    return error if len(error) <= width else error[: width - 3] + "..."
