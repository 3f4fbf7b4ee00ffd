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
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence

from gem_model._deps import TorchrecImportError, import_torchrec
from gem_model.errors import (
    ConfigError,
    GemError,
    IncompatibleCheckpointError,
    NonFiniteError,
    PeerError,
    RunInterrupted,
    UnknownNameError,
)

# Nothing heavy is imported at module level (torch, torchrec, pydantic models, the plugins): `--help`
# and a bad command line answer at once; each command imports what it needs when it runs.

EXIT_FAILURE, EXIT_USAGE, EXIT_NON_FINITE = 1, 2, 3


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="a .yaml/.yml/.toml run config (default: the tiny CPU run)")
    p.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="config overrides (before, between or after the options)"
    )


def build_parser() -> argparse.ArgumentParser:
    from gem_model.data.convert import add_data_parser
    from gem_model.launch import add_launch_args
    from gem_model.profile import add_profile_parser
    from gem_model.tune.cli import add_tune_parser

    parser = argparse.ArgumentParser(prog="gem-train", description="Train GEM-style recommendation models.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train a model")
    _add_config_args(run)
    add_launch_args(run)
    plugins = sub.add_parser("plugins", help="list installed plugins, the hooks they implement and the names they register")
    plugins.add_argument("--options", action="store_true",
                         help="also each component's options: type, default and description")  # fmt: skip
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
    cfg = sub.add_parser("config", help="print the resolved config (each component's options filled in) and its JSON schema")
    _add_config_args(cfg)
    cfg.add_argument("--only", choices=["config", "schema"], help="print just one of the two")
    add_profile_parser(sub)
    add_tune_parser(sub)
    add_data_parser(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser``'s arguments, with ``key=value`` items allowed before, between and after the options."""
    args, extra = parser.parse_known_args(argv)
    # argparse gives a `nargs="*"` positional only its first run of values; the later ones come back
    # here, in command-line order, after those it took
    field = next((f for f in ("overrides", "options") if isinstance(getattr(args, f, None), list)), None)
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and field is None):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        setattr(args, field, [*getattr(args, field), *extra])
    return args


def _fail(message: str, code: int) -> int:
    print(f"gem-train: error: {message}", file=sys.stderr)
    return code


def cmd_run(args: argparse.Namespace) -> int:
    from gem_model import launch
    from gem_model.checks import preflight
    from gem_model.distributed import launched_by_torchrun
    from gem_model.plugins import GemPluginManager
    from gem_model.train import resume
    from gem_model.train.stacks import print_stacks_on_signal

    print_stacks_on_signal()  # kill -USR1 <pid>: where this process is, printed to stderr
    launch.set_cuda_allocator()  # before the checks (which may start CUDA); torchrun's processes inherit it
    pm = GemPluginManager()
    launched = launched_by_torchrun()
    if launched:
        world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        notice = launch.node_notice()
        if notice is not None:
            print(notice, file=sys.stderr, flush=True)
    else:
        world, local = max(launch.world_size(args), 1), max(args.nproc, 1)
    # every name, option and constraint, all together, before any process starts
    config, components = preflight(args.config, args.overrides, pm, world_size=world, local_processes=local,
                                   before=launch.launch_problems(args))  # fmt: skip
    resume.check_before_build(config, world, pm)  # writable, not locked, resume and metrics as asked
    if not launched and (launch.needs_torchrun(args) or components.planner.needs_process_group):
        if not launch.needs_torchrun(args):
            print(f"gem-train: parallel.planner {components.planner.name!r} needs a process group: starting torchrun "
                  "with one process", file=sys.stderr)  # fmt: skip
        argv = launch.torchrun_argv(args, (["-c", args.config] if args.config else []) + list(args.overrides))
        sys.stdout.flush()
        os.execve(sys.executable, argv, launch.torchrun_env(args))
    from gem_model.trainer import train

    train(config, pm, components=components)
    # the components (planner, comm strategy) keep the run's process groups in reference cycles: freed
    # here, while the interpreter is whole, so that no gloo thread is torn down with it at exit (which
    # aborts the process now and then: SIGABRT, "terminate called without an active exception")
    del components
    gc.collect()
    if launched:
        from gem_model.distributed import leave_rank

        leave_rank(0)
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from gem_model.plugin_report import plugins_report
    from gem_model.plugins import GemPluginManager

    print(plugins_report(GemPluginManager(), options=args.options))
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from gem_model.checks import preflight
    from gem_model.plugins import GemPluginManager
    from gem_model.train.prepare import offline_plan

    before = [] if args.world_size >= 1 else [("--world-size (--nproc)", args.world_size, "must be at least 1")]
    per_node = args.gpus_per_node or min(max(args.world_size, 1), 8)
    if per_node < 1:
        before.append(("--gpus-per-node", args.gpus_per_node, "must be at least 1"))
        per_node = 1
    # the checks gem-train run makes, for the world asked for
    config, components = preflight(args.config, args.overrides, GemPluginManager(), world_size=max(args.world_size, 1),
                                   local_processes=per_node, offline=True, before=before)  # fmt: skip
    plan = offline_plan(config, components, world_size=args.world_size, ranks_per_node=per_node)
    print(plan.to_json() if args.json else plan.format())
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from gem_model.checks import preflight
    from gem_model.config import RunConfig
    from gem_model.plugins import GemPluginManager
    from gem_model.resolve import dump_resolved

    if args.only != "schema":
        config, components = preflight(args.config, args.overrides, GemPluginManager(), offline=True)
        print(dump_resolved(config, components), end="")
    if args.only is None:
        print("# --- JSON schema ---")
    if args.only != "config":
        print(json.dumps(RunConfig.model_json_schema(), indent=1))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from gem_model import quiet

    quiet.install()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["profile"]:  # its subcommands come from plugins: parsed once they are loaded
        from gem_model.profile import profile_help, profile_main

        if argv[1:] in (["-h"], ["--help"]):  # answered without loading the plugins (and torch)
            return profile_help()
        args = argparse.Namespace(command="profile", profile_handler=profile_main, profile_argv=argv[1:])
    else:
        args = parse_args(build_parser(), argv)
    if args.command != "run":
        return _dispatch(args)
    from gem_model.distributed import launched_by_torchrun

    if not launched_by_torchrun():
        return _dispatch(args)
    try:
        code = _dispatch(args)
    except Exception:  # reported as the interpreter would, then the rank leaves below
        traceback.print_exc()
        code = EXIT_FAILURE
    _leave_failed_rank(code)
    return code  # 0: the run already left through leave_rank


def _leave_failed_rank(code: int) -> None:
    """A torchrun-launched rank whose run failed leaves like one that succeeded (``leave_rank``).

    The failed run's process groups are left by then (``started_run`` destroys them on the way out),
    but a torchrec-sharded run keeps one reference to its gloo group that Python cannot reach; torn down
    with the interpreter, its threads abort the rank now and then (SIGABRT), and torchrun would report
    ``Signal 6`` in place of the status the error asked for (3 for a NaN, 1 for an unexpected
    exception, whose traceback is printed first)."""
    from gem_model.distributed import leave_rank

    if code != 0:  # at once: torchrun stops the other ranks ~0.1 s after this one is gone (no collection first)
        leave_rank(code)


PEER_GRACE_S = 1.0
"""How long a torchrun-launched rank whose peer died or stalled waits before it leaves."""


def _let_torchrun_see_the_peer_first() -> None:
    """torchrun names as the root cause the first failure it sees, polling its ranks every 0.1 s (its
    default ``--monitor-interval``) and taking the ranks of one poll in order. A rank whose collective
    failed because a peer died would, leaving at once, often be seen in the same poll as the dead peer
    and named in its place; it leaves ``PEER_GRACE_S`` later (where torchrun stops it first: SIGTERM,
    its error already printed)."""
    from gem_model.distributed import launched_by_torchrun

    if launched_by_torchrun():
        time.sleep(PEER_GRACE_S)


def _dispatch(args: argparse.Namespace) -> int:
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
    except PeerError as exc:
        code = _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILURE)
        _let_torchrun_see_the_peer_first()
        return code
    except GemError as exc:
        return _fail(f"{type(exc).__name__}: {exc}", EXIT_FAILURE)
    except TorchrecImportError as exc:
        return _fail(str(exc), EXIT_FAILURE)
