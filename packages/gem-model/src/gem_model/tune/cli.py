"""The ``gem-train tune`` command line (:mod:`gem_model.tune.search`).

``--profile DIR`` reads ``DIR/profile.json``; where there is none yet, tune first makes the sections
it reads (:data:`TUNE_SECTIONS`, no training steps) into ``DIR``, out of its own budget.
``--compare OTHER`` searches nothing: it measures the config and ``OTHER`` (e.g. the ``tuned.yaml``
of an earlier search) the same way, under the same ``--steps``, and writes ``compare.json``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from gem_model.errors import ConfigError

TUNE_SECTIONS = ("memory", "numerics")
"""What tune reads from a profile (the activation policies' memory, the per-layer precision map)."""


def add_tune_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tune", help="search kernels, precision, activation policy, balancer and planner by short runs")
    p.add_argument("-c", "--config", help="a .yaml/.yml/.toml run config (default: the tiny CPU run)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")
    p.add_argument("--budget", type=float, help="minutes the whole search may take (required unless --compare)")
    p.add_argument("--steps", type=int, default=6, help="training steps per candidate")
    p.add_argument("--repeats", type=int, default=1, help="runs per config in a row; the last one counts")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the uncounted first run of the config (it compiles and tunes the kernels)")
    p.add_argument("--memory-gb", type=float, help="largest accepted peak memory per GPU")
    p.add_argument("--max-loss-increase", type=float, default=0.05, help="largest accepted relative loss increase")
    p.add_argument("--profile", type=Path, help="a `gem-train profile` directory (its numerics map is a candidate)")
    p.add_argument("--out", type=Path, help="where tuned.yaml and tune.json go (default: <output_dir>/tune)")
    p.add_argument("--dimensions", help="comma-separated: kernel, precision, activation, balancer, planner, compile (default: all)")
    p.add_argument("--compare", type=Path, metavar="OTHER",
                   help="search nothing: measure the config and OTHER (a config file) under the same --steps")  # fmt: skip
    p.set_defaults(profile_handler=tune_main)


def tune_main(args: argparse.Namespace) -> int:
    from gem_model.config_io import load_config
    from gem_model.plugins import GemPluginManager
    from gem_model.profiling.render import load_report
    from gem_model.tune.search import check_dimensions, tune, write_result

    if args.compare is None and args.budget is None:
        raise ConfigError([("--budget", None, "give the minutes the search may take")])
    if (args.budget is not None and not args.budget > 0) or args.steps < 2 or args.repeats < 1:
        raise ConfigError([("--budget/--steps/--repeats", (args.budget, args.steps, args.repeats),
                            "a budget > 0, at least 2 steps and at least 1 repeat")])  # fmt: skip
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # each rank would time and choose on its own
        raise ConfigError([("WORLD_SIZE", os.environ["WORLD_SIZE"], "gem-train tune measures candidates on "
                            "one device: run it in one process (torchrun --nproc-per-node 1 where the "
                            "planner needs a process group)")])  # fmt: skip
    from gem_model.checks import preflight

    config, _ = preflight(args.config, args.overrides, GemPluginManager(), offline=True)  # every problem at once
    out = args.out or Path(config.trainer.output_dir.format(name=config.name)) / "tune"
    if args.compare is not None:
        return _compare(config, load_config(args.compare, []), args, out)
    only = None if args.dimensions is None else tuple(n.strip() for n in args.dimensions.split(",") if n.strip())
    check_dimensions(only)  # before a profile is made for nothing
    start = time.perf_counter()
    profile = None
    if args.profile is not None:
        if not (args.profile / "profile.json").is_file():
            _profile_for_tune(config, args.profile, args.budget * 60)
        profile = load_report(args.profile)
    budget_s = args.budget * 60 - (time.perf_counter() - start)
    result = tune(config, GemPluginManager(), budget_s=budget_s, steps=args.steps, memory_gb=args.memory_gb,
                  max_loss_increase=args.max_loss_increase, profile=profile, only=only,
                  on_candidate=lambda so_far: write_result(so_far, out),  # tune.json after every candidate
                  warmup=args.warmup, repeats=args.repeats)  # fmt: skip
    from rich.table import Table

    from gem_model.terminal import print_table

    table = Table(title=f"gem-train tune: {len(result.candidates)} candidate(s) in {result.seconds:.0f} s")
    for col in ("dimension", "change", "tokens/s", "peak GB", "last loss", "s", "chosen / error"):
        table.add_column(col, overflow="fold")
    for c in [result.baseline, *result.candidates]:
        table.add_row(*_row(c))
    print_table(table)
    for what, path in write_result(result, out).items():
        print(f"wrote {what}: {path}")
    if result.stopped_by_budget:
        print("stopped by the budget: not every candidate was tried")
    return 0


def _row(c: Any) -> list[str]:
    change = ", ".join(f"{k}={v}" for k, v in c.overrides.items()) or "(the config)"
    fmt = [f"{c.tokens_per_s:,.0f}" if c.tokens_per_s else "-", f"{c.peak_memory_gb:.2f}" if c.peak_memory_gb else "-",
           f"{c.last_loss:.4f}" if c.last_loss is not None else "-"]  # fmt: skip
    verdict = c.skipped or (_short(c.error) if c.error else ("yes" if c.chosen else ""))
    return [c.dimension, change, *fmt, f"{c.seconds:.1f}", _short(verdict)]


def _profile_for_tune(config: Any, out: Path, budget_s: float) -> None:
    """The sections tune reads, into ``out`` (no training steps), each under a third of the budget."""
    from gem_model.plugins import GemPluginManager
    from gem_model.profiling.render import write_outputs
    from gem_model.profiling.runner import ProfileOptions, registered_sections, run_profile

    pm = GemPluginManager()
    sections = tuple(n for n in TUNE_SECTIONS if n in registered_sections(pm))
    print(f"gem-train tune: {out / 'profile.json'} does not exist; profiling {', '.join(sections)} into it first")
    report = run_profile(config, pm, ProfileOptions(out=out, batches=1, sections=sections, section_budget_s=budget_s / 3))
    assert report is not None  # tune runs in one process: rank 0
    write_outputs(report, out)


def _compare(config: Any, other: Any, args: argparse.Namespace, out: Path) -> int:
    import json

    from gem_model.plugins import GemPluginManager
    from gem_model.tune.search import compare, compare_means

    names = {str(args.config or "(the default config)"): config, str(args.compare): other}
    if len(names) < 2:
        raise ConfigError([("--compare", str(args.compare), "is the config itself; name another config")])
    from rich.table import Table

    from gem_model.terminal import print_table

    measured = compare(names, GemPluginManager(), args.steps)
    table = Table(title=f"gem-train tune --compare: {args.steps} steps a run, in the order A, B, B, A")
    for col in ("dimension", "config", "tokens/s", "peak GB", "last loss", "s", ""):
        table.add_column(col, overflow="fold")
    for c in measured:
        table.add_row(*_row(c))
    print_table(table)
    means = compare_means(measured)
    (first, a), (second, b) = means.items()
    if a["tokens_per_s"] and b["tokens_per_s"]:
        print(f"{second}: {b['tokens_per_s'] / a['tokens_per_s']:.3f}x the tokens/s of {first} "
              f"(means of {b['runs']} and {a['runs']} runs: {b['tokens_per_s']:,.0f} / {a['tokens_per_s']:,.0f})")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    path = out / "compare.json"
    from dataclasses import asdict

    path.write_text(json.dumps({"steps": args.steps, "order": "A, B, B, A", "runs": [asdict(c) for c in measured],
                                "means": means}, indent=1))  # fmt: skip
    print(f"wrote comparison: {path}")
    return 0


def _short(error: str, width: int = 90) -> str:
    """The table's cell; tune.json keeps the whole message."""
    return error if len(error) <= width else error[: width - 3] + "..."
