"""``gem-train profile`` and ``gem-train report``: the command line of :mod:`gem_model.profiling`.

- ``gem-train profile -c CONFIG [--out DIR]`` (or ``profile all ...``): the full report, printed as
  tables and written to ``DIR`` (default: the config's ``trainer.output_dir``) as ``profile.json``,
  PNG plots and ``profile.html``;
- ``gem-train profile data``: the sequences section alone, printed;
- ``gem-train profile <name>``: a plugin's subcommand (``gem_profile_commands``), e.g. ``precision``
  from gem-precision;
- ``gem-train report RUN_DIR``: the tables, plots and HTML again, from ``RUN_DIR/profile.json``.

The ``profile`` subcommands come from the installed plugins, so its arguments are parsed once they
are loaded (:func:`profile_main`), not by the top-level parser.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from gem_model.errors import ConfigError, UnknownNameError

# subcommands our own packages add, so that a missing one can say what to install
KNOWN_COMMANDS = {"precision": "gem-precision"}


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", add_help=False,
        help="profile the workload: sequences, balance, numerics, memory, communication, step time, MFU "
        "(`gem-train profile --help` lists the subcommands)",
    )  # fmt: skip
    p.set_defaults(profile_handler=profile_main, profile_argv=[])
    r = sub.add_parser("report", help="re-render a profile's tables, plots and HTML from RUN_DIR/profile.json")
    r.add_argument("run_dir", type=Path)
    r.set_defaults(profile_handler=report_main)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="a .yaml/.yml/.toml run config (default: the tiny CPU run)")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config overrides")


def profile_parser(commands: dict[str, object]) -> argparse.ArgumentParser:
    from gem_model.profiling.context import ProfileCommand

    parser = argparse.ArgumentParser(prog="gem-train profile", description="Profile the workload's shape.")
    kinds = parser.add_subparsers(dest="profile_kind", required=True)
    full = kinds.add_parser("all", help="the full report (also `gem-train profile -c CONFIG` with no subcommand)")
    _config_args(full)
    full.add_argument("--out", type=Path, help="where the report goes (default: the config's trainer.output_dir)")
    full.add_argument("--world", type=int, help="processes to assume for balance, memory and communication")
    full.add_argument("--batches", type=int, default=8, help="global batches the data sections read")
    full.add_argument("--warmup", type=int, default=2, help="training steps before the measured ones")
    full.add_argument("--steps", type=int, default=3, help="measured training steps (torch.profiler)")
    full.add_argument("--baseline", type=Path, help="a one-GPU profile's directory, for scaling efficiency")
    full.add_argument("--sections", help="comma-separated sections to make (default: all; a wrong name lists them)")
    full.add_argument("--section-budget", type=float, metavar="SECONDS",
                      help="cut a section off past this many seconds; the report says so and goes on")  # fmt: skip
    full.set_defaults(run=profile_all)
    data = kinds.add_parser("data", help="sequence lengths, tokens and padding waste of the configured data")
    _config_args(data)
    data.add_argument("--batches", type=int, default=20)
    data.set_defaults(run=profile_data)
    for name, command in commands.items():
        assert isinstance(command, ProfileCommand)
        p = kinds.add_parser(name, help=command.help)
        command.add_arguments(p)
        p.set_defaults(run=command.run)
    for name, dist in KNOWN_COMMANDS.items():
        if name not in commands:
            p = kinds.add_parser(name, help=f"(provided by {dist}, which is not installed)", add_help=False)
            p.set_defaults(run=None, missing=f"`gem-train profile {name}` is provided by {dist}, which is not installed")
    return parser


def profile_help() -> int:
    """``gem-train profile --help`` without loading the plugins (that would import torch): the core's
    subcommands, those our packages add (installed or not, from the package metadata), and a pointer
    to the others."""
    from importlib import metadata

    installed = {}
    for name, dist in KNOWN_COMMANDS.items():
        try:
            metadata.distribution(dist)
            installed[name] = dist
        except metadata.PackageNotFoundError:
            pass
    parser = profile_parser({})
    parser.epilog = (
        "Installed plugins add subcommands of their own"
        + (f" ({', '.join(f'{n} from {d}' for n, d in installed.items())})" if installed else "")
        + ": `gem-train plugins` lists them, `gem-train profile NAME --help` shows one's options."
    )
    kinds = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, dist in installed.items():
        kinds.choices.pop(name, None)
        kinds._choices_actions = [a for a in kinds._choices_actions if a.dest != name]
        kinds.add_parser(name, help=f"from {dist}: `gem-train profile {name} --help`", add_help=False)
    parser.print_help()
    return 0


def profile_main(args: argparse.Namespace) -> int:
    from gem_model.plugins import GemPluginManager

    pm = GemPluginManager()
    commands: dict[str, object] = {}
    for group in pm.call("gem_profile_commands"):
        for command in group or ():
            if command.name in commands or command.name in ("all", "data"):
                raise ConfigError([("gem_profile_commands", command.name, "a profile subcommand of that name exists")])
            commands[command.name] = command
    parser = profile_parser(commands)
    argv = list(args.profile_argv)
    names = {"all", "data", *commands, *KNOWN_COMMANDS}
    if not argv or (argv[0] not in names and argv[0] not in ("-h", "--help")):
        argv = ["all", *argv]
    parsed, extra = parser.parse_known_args(argv)
    if getattr(parsed, "missing", None):
        raise UnknownNameError(parsed.missing)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return parsed.run(parsed, pm)


def profile_all(args: argparse.Namespace, pm: object) -> int:
    from gem_model.checks import preflight
    from gem_model.profiling.render import print_report, write_outputs
    from gem_model.profiling.runner import ProfileOptions, run_profile, unfinished

    # every problem of the command line at once, before anything is profiled (no device or memory
    # check: the profile measures those)
    config, _ = preflight(args.config, args.overrides, pm, offline=True)  # type: ignore[arg-type]
    out = args.out or Path(config.trainer.output_dir.format(name=config.name))
    sections = None if args.sections is None else tuple(n.strip() for n in args.sections.split(",") if n.strip())
    options = ProfileOptions(out=out, batches=args.batches, warmup=args.warmup, steps=args.steps, world=args.world,
                             baseline=args.baseline, sections=sections, section_budget_s=args.section_budget)  # fmt: skip
    report = run_profile(config, pm, options)  # type: ignore[arg-type]
    if report is None:  # not global rank 0: it took part in the measured steps only
        return 0
    print_report(report)
    for what, path in write_outputs(report, out).items():
        print(f"wrote {what}: {path}")
    not_done = unfinished(report)
    for name, status in not_done.items():
        print(f"section {name}: {status.replace('_', ' ')} ({report.section(name).summary['error']})")
    return 1 if "failed" in not_done.values() else 0


def report_main(args: argparse.Namespace) -> int:
    from gem_model.profiling.render import load_report, print_report, write_outputs

    try:
        report = load_report(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError([("RUN_DIR", str(args.run_dir), str(exc))]) from None
    print_report(report)
    for what, path in write_outputs(report, args.run_dir, json_too=False).items():
        print(f"wrote {what}: {path}")
    return 0


def profile_data(args: argparse.Namespace, pm: object) -> int:
    """Print the sequences section (Meta's lesson: look at the data before picking a recipe)."""
    from gem_model.config_io import load_config
    from gem_model.profiling.context import ProfileContext
    from gem_model.profiling.render import print_report
    from gem_model.profiling.report import ProfileReport
    from gem_model.profiling.sequences import read_history, sequences_section

    config = load_config(args.config, args.overrides)
    entry = pm.data_sources.get(config.data.source.name)  # type: ignore[attr-defined]
    source = entry.cls(entry.cls.Config.model_validate(config.data.source.options))
    ctx = ProfileContext(config, pm, None, 1, 1, args.batches, Path("."))  # type: ignore[arg-type]
    section = sequences_section(ctx, read_history(ctx, source))
    print_report(ProfileReport(config.name, "-", "-", "gem-train profile data", [section]))
    s = section.summary
    print(f"{100 * (1 - s['padding_waste_to_max']):.1f} % useful when padded to the longest; "
          f"{100 * (1 - s['padding_waste_to_buckets']):.1f} % useful with power-of-two buckets")  # fmt: skip
    return 0
