"""``gem-train`` (also ``python -m gem_model``): run, plugins, plan, config.

Exit status:

- 0: success.
- 2: a bad command line or config (unknown names, bad values, constraints across fields and
  against the data, an output directory that cannot be written, is in use by another run or holds
  another run's metrics, ``trainer.resume=true`` with nothing to resume): always before any model
  is built. Also a checkpoint that does not fit the run
  (:class:`~gem_model.errors.IncompatibleCheckpointError`: the first mismatched tensors, both
  shapes, the config fields that differ), before any tensor loads, and one that would run code
  (:class:`~gem_model.errors.UnsafeCheckpointError`), before any of it runs.
- 3: a NaN or Inf stopped the run (:class:`~gem_model.errors.NonFiniteError`): the loss (no update
  was applied) or parameters a checkpoint would have saved (it was not written).
- 143 / 130: SIGTERM / SIGINT stopped the run after the step in progress, once the checkpoint of
  that step was written (``128 + signum``, :mod:`gem_model.train.signals`).
- 1: any other failure of training itself (e.g. no valid checkpoint to resume, a peer that died or
  stalled: :class:`~gem_model.errors.PeerError`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence

from gem_model._deps import TorchrecImportError, import_torchrec
from gem_model.config_io import dump, load_config
from gem_model.errors import (
    ConfigError,
    GemError,
    IncompatibleCheckpointError,
    NonFiniteError,
    RunInterrupted,
    UnknownNameError,
)

EXIT_FAILURE, EXIT_USAGE, EXIT_NON_FINITE = 1, 2, 3


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="a .yaml/.yml/.toml run config (default: the tiny CPU run)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gem-train", description="Train GEM-style recommendation models.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train a model")
    _add_config_args(run)
    from gem_model.launch import add_launch_args

    add_launch_args(run)
    sub.add_parser("plugins", help="list installed plugins, the hooks they implement and the names they register")
    plan = sub.add_parser(
        "plan", help="print the parallel plan a run would get (layout, tables, dense modules; a planner's prediction)"
    )
    _add_config_args(plan)
    plan.add_argument(
        "--world-size", "--nproc", dest="world_size", type=int, default=1,
        help="plan for this many processes in all (none are started)",
    )  # fmt: skip
    plan.add_argument(
        "--gpus-per-node", type=int, help="processes per node, for a planner that places dims on links (default: "
        "the world size up to 8)",
    )  # fmt: skip
    plan.add_argument("--json", action="store_true", help="print the plan as JSON (as saved beside checkpoints)")
    cfg = sub.add_parser("config", help="print the resolved config and its JSON schema")
    _add_config_args(cfg)
    cfg.add_argument("--only", choices=["config", "schema"], help="print just one of the two")
    from gem_model.data.convert import add_data_parser
    from gem_model.profile import add_profile_parser

    add_profile_parser(sub)
    from gem_model.tune.cli import add_tune_parser

    add_tune_parser(sub)
    add_data_parser(sub)
    return parser


def _fail(message: str, code: int) -> int:
    print(f"gem-train: error: {message}", file=sys.stderr)
    return code


def cmd_run(args: argparse.Namespace) -> int:
    from gem_model import launch
    from gem_model.checks import check_run
    from gem_model.distributed import launched_by_torchrun
    from gem_model.plugins import GemPluginManager
    from gem_model.resolve import resolve_components
    from gem_model.train import resume

    config = load_config(args.config, args.overrides)
    pm = GemPluginManager()
    components = resolve_components(config, pm)  # every name and option checked before any process starts
    launch.check_launch_args(args)
    world = launch.world_size(args) if not launched_by_torchrun() else int(os.environ.get("WORLD_SIZE", "1"))
    limit = components.planner.max_world_size
    if limit is not None and world > limit:
        raise ConfigError(
            [("parallel.planner", config.parallel.planner.name,
              f"drives at most {limit} process(es) but {world} were asked for; pick a distributed planner "
              "such as torchrec_ddp")]
        )
    per_node = args.nproc if not launched_by_torchrun() else int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
    check_run(config, components, world, ranks_per_node=per_node)
    resume.check_before_build(config, world, pm)  # writable, not locked, resume and metrics as asked
    if launch.needs_torchrun(args) and not launched_by_torchrun():
        argv = launch.torchrun_argv(args, (["-c", args.config] if args.config else []) + list(args.overrides))
        sys.stdout.flush()
        os.execv(sys.executable, argv)
    from gem_model.trainer import train

    train(config, pm)
    return 0


def cmd_plugins(_: argparse.Namespace) -> int:
    from gem_model.plugin_report import plugins_report
    from gem_model.plugins import GemPluginManager

    print(plugins_report(GemPluginManager()))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from gem_model.checks import check_run
    from gem_model.plugins import GemPluginManager
    from gem_model.resolve import resolve_components
    from gem_model.train.prepare import offline_plan

    config = load_config(args.config, args.overrides)
    components = resolve_components(config, GemPluginManager())
    limit = components.planner.max_world_size
    if args.world_size < 1 or (limit is not None and args.world_size > limit):
        raise ConfigError([("--world-size (--nproc)", args.world_size, f"must be in [1, {limit or 'any'}] for parallel.planner {components.planner.name!r}")])
    per_node = args.gpus_per_node or min(args.world_size, 8)
    if per_node < 1:
        raise ConfigError([("--gpus-per-node", args.gpus_per_node, "must be at least 1")])
    check_run(config, components, args.world_size, ranks_per_node=per_node)  # the checks gem-train run makes
    plan = offline_plan(config, components, world_size=args.world_size, ranks_per_node=per_node)
    print(plan.to_json() if args.json else plan.format())
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from gem_model.config import RunConfig
    from gem_model.plugins import GemPluginManager
    from gem_model.resolve import resolve_components

    config = load_config(args.config, args.overrides)
    if args.only != "schema":
        resolve_components(config, GemPluginManager())
        print(dump(config), end="")
    if args.only is None:
        print("# --- JSON schema ---")
    if args.only != "config":
        print(json.dumps(RunConfig.model_json_schema(), indent=1))
    return 0


class _DropFxTracingNotice(logging.Filter):
    """torch.fx logs "is_fx_tracing will return true for both fx.symbolic_trace and torch.export ..."
    once per process when torchrec's code calls ``torch.fx._symbolic_trace.is_fx_tracing()``: advice
    to torchrec's authors, nothing a user of gem-train can act on. Only that message is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("is_fx_tracing will return true")


def main(argv: Sequence[str] | None = None) -> int:
    logging.getLogger("torch.fx._symbolic_trace").addFilter(_DropFxTracingNotice())
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["profile"]:  # its subcommands come from plugins: parsed once they are loaded
        from gem_model.profile import profile_main

        args = argparse.Namespace(command="profile", profile_handler=profile_main, profile_argv=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    handlers = {"run": cmd_run, "plugins": cmd_plugins, "plan": cmd_plan, "config": cmd_config, "profile": None}
    try:
        # before any plugin loads: a plugin module (e.g. gem_parallel.sharded) may import torchrec
        # first, and a broken fbgemm-gpu should fail with the fix named, not a bare library error
        import_torchrec()
        if args.command in ("profile", "report", "tune"):
            return args.profile_handler(args)
        if args.command == "data":
            return args.data_handler(args)
        return handlers[args.command](args)
    except (ConfigError, UnknownNameError) as exc:
        return _fail(str(exc), EXIT_USAGE)
    except IncompatibleCheckpointError as exc:
        return _fail(f"{type(exc).__name__}: {exc}", EXIT_USAGE)
    except NonFiniteError as exc:
        return _fail(f"{type(exc).__name__}: {exc}", EXIT_NON_FINITE)
    except RunInterrupted as exc:
        print(f"gem-train: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except GemError as exc:
        return _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILURE)
    except TorchrecImportError as exc:
        return _fail(str(exc), EXIT_FAILURE)
