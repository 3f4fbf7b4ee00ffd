"""The cost of the output-directory lock and the soundness check against the step (issue 32: under
0.5 % of a big-config step).

What they add to a run, and where:
- per step, on the host after the step's one sync (the loss read): ``Soundness.trained`` (nothing
  to do on most steps; on the first step after a checkpoint, rank 0 rewrites
  ``<output_dir>/soundness.json``). Its host time is an upper bound on what it adds to the step,
  since the step's backward and update are already queued on the device when it runs;
- per run, before the model is built: ``resume.check_before_build`` (the output directory's
  writability probe, the lock check, the metrics file's owner) and rank 0's ``OutputLock``
  acquire and release; spread over the run's steps;
- per checkpoint: the save's two agreement all-reduces replace the three barriers it had, and the
  start-up all-reduce carries one more number: nothing is added there, and nothing is timed.

Nothing can be switched off, so no trainer run with them is compared against one without: the
functions are timed themselves (``--repeats`` times, the median kept) in an output directory of
the config, and reported as a share of the step time. The step time is ``--step-ms`` when given;
otherwise the trainer runs ``--measure-steps`` steps of the same config in this process (the
median ``step_seconds`` after ``--skip-steps``). The run length and checkpoint interval the costs
are spread over are the config's ``trainer.steps`` and ``trainer.checkpoint_every`` (or
``--checkpoint-every`` where it checkpoints only at the end).

On one H200 (torchrun with one process: the big config's fused tables need a process group)::

    torchrun --standalone --nproc-per-node 1 benchmarks/reliability_overhead.py -c configs/h200-large.yaml \\
        --measure-steps 30 --out benchmarks/results/raw/reliability_overhead_h200.json

On the CPU, a smoke run on the tiny config (``tests/test_reliability_bench.py`` runs this)::

    python benchmarks/reliability_overhead.py -c configs/tiny.yaml --device cpu --measure-steps 4 --out rel.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gem_model.config import RunConfig
from gem_model.config_io import load_config
from gem_model.plugins import GemPluginManager
from gem_model.train import resume
from gem_model.train.lock import OutputLock
from gem_model.train.outputs import output_dir
from gem_model.train.soundness import Soundness

BUDGET = 0.005  # the bound on their share of a step


def median_ms(fn: Callable[[], object], repeats: int, setup: Callable[[], object] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        setup()
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def time_costs(config: RunConfig, pm: GemPluginManager, args: argparse.Namespace) -> dict[str, float]:
    """Host milliseconds of each piece, in an output directory laid out as the run's."""
    out = output_dir(config)
    root = out / "checkpoints"
    checkpoints = [root / f"step_{s:08d}" for s in range(1, args.marks + 1)]
    for path in checkpoints:
        path.mkdir(parents=True, exist_ok=True)
    known = Soundness(writes=True)
    for path in checkpoints[:-1]:  # a marks file as a long run has it
        known.written(path)
        known.trained(int(path.name[5:]) + 1, 1.0)
    idle = Soundness(writes=True)
    idle_ms = median_ms(lambda: idle.trained(7, 1.0), args.repeats * 100)  # the common step: nothing unproven
    marking_ms = median_ms(lambda: known.trained(8, 1.0), args.repeats, setup=lambda: known.written(checkpoints[-1]))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_ms = median_ms(lambda: resume.check_before_build(config, world, pm), args.repeats)
    held = OutputLock(out)

    def lock_cycle() -> None:
        if held.acquire() is not None:
            raise SystemExit(f"{out} is held by another run: {held.path}")
        held.release()

    lock_ms = median_ms(lock_cycle, args.repeats)
    return {"soundness_step_ms": idle_ms, "soundness_mark_ms": marking_ms, "check_before_build_ms": check_ms,
            "lock_ms": lock_ms}  # fmt: skip


def measure_step_ms(config_path: str | None, overrides: list[str], pm: GemPluginManager, args: argparse.Namespace) -> float:
    """The median step time of ``--measure-steps`` trainer steps of the config (after ``--skip-steps``)."""
    from gem_model.trainer import train

    with tempfile.TemporaryDirectory(prefix="gem-rel-") as workdir:
        config = load_config(config_path, [
            *overrides, f"trainer.steps={args.measure_steps}", "trainer.log_every=1", "trainer.progress=false",
            "trainer.checkpoint_every=0", "trainer.checkpoint_at_end=false", "trainer.eval_at_end=false",
            "trainer.eval_every=0", "trainer.resume=false", f"trainer.output_dir={workdir}",
        ])  # fmt: skip
        train(config, pm)
        lines = [json.loads(x) for x in (Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    seconds = [r["step_seconds"] for r in lines if "step_seconds" in r][args.skip_steps :]
    if not seconds:
        raise SystemExit(f"--skip-steps {args.skip_steps} leaves none of the {args.measure_steps} measured steps")
    return 1e3 * statistics.median(seconds)


def summarise(costs: dict[str, float], step_ms: float, source: str, config: RunConfig, args: argparse.Namespace,
              argv: list[str]) -> dict:  # fmt: skip
    steps = config.trainer.steps
    every = config.trainer.checkpoint_every or args.checkpoint_every or steps
    per_step = {
        "soundness (every step)": costs["soundness_step_ms"],
        f"soundness marks (1 in {every} steps)": costs["soundness_mark_ms"] / every,
        f"start-up checks (1 in {steps} steps)": costs["check_before_build_ms"] / steps,
        f"lock (1 in {steps} steps)": costs["lock_ms"] / steps,
    }
    total = sum(per_step.values())
    return {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if config.trainer.device != "cpu" and torch.cuda.is_available() else "cpu",
            "host": platform.processor() or platform.machine(),
            "command": shlex.join([sys.executable, *sys.argv[:1], *argv]),
            "config": config.name,
            "steps": steps,
            "checkpoint_every": every,
        },
        "host_ms": costs,
        "per_step_ms": per_step,
        "step_ms": step_ms,
        "step_ms_from": source,
        "share": total / step_ms,
        "budget": BUDGET,
        "within_budget": total / step_ms <= BUDGET,
    }


def print_table(out: dict) -> None:
    m = out["meta"]
    print(f"\n{m['config']}: {m['steps']} steps, a checkpoint every {m['checkpoint_every']}")
    print(f"{'piece':<40} {'host ms':>10} {'per step ms':>12}")
    names = ["soundness_step_ms", "soundness_mark_ms", "check_before_build_ms", "lock_ms"]
    for name, (piece, per_step) in zip(names, out["per_step_ms"].items(), strict=True):
        print(f"{piece:<40} {out['host_ms'][name]:>10.4f} {per_step:>12.6f}")
    share = out["share"]
    print(f"step {out['step_ms']:.1f} ms ({out['step_ms_from']}): together {100 * share:.4f} % of it; budget "
          f"{100 * out['budget']:g} %: {'within' if out['within_budget'] else 'OVER'}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", default="configs/h200-large.yaml")
    p.add_argument("--device", default=None, help="trainer.device (default: the config's)")
    p.add_argument("--repeats", type=int, default=20, help="timings of each piece (the median kept)")
    p.add_argument("--marks", type=int, default=50, help="checkpoints already in the marks file")
    p.add_argument("--checkpoint-every", type=int, default=100, help="where the config checkpoints only at the end")
    p.add_argument("--step-ms", type=float, default=None, help="the step time; without it the trainer measures it")
    p.add_argument("--measure-steps", type=int, default=30, help="trainer steps run to measure the step time")
    p.add_argument("--skip-steps", type=int, default=None, help="first steps left out (default: a third)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)
    if min(args.repeats, args.marks, args.checkpoint_every, args.measure_steps) < 1:
        p.error("--repeats, --marks, --checkpoint-every and --measure-steps must be at least 1")
    if args.skip_steps is None:
        args.skip_steps = args.measure_steps // 3
    overrides = [*([f"trainer.device={args.device}"] if args.device else []), *args.set]
    pm = GemPluginManager()
    if args.step_ms is not None:
        step_ms, source = args.step_ms, "given"
    else:
        step_ms = measure_step_ms(args.config, overrides, pm, args)
        source = f"median of trainer steps {args.skip_steps + 1}..{args.measure_steps}"
    with tempfile.TemporaryDirectory(prefix="gem-rel-out-") as workdir:
        config = load_config(args.config, [*overrides, f"trainer.output_dir={workdir}/{{name}}"])
        costs = time_costs(config, pm, args)
    out = summarise(costs, step_ms, source, config, args, argv)
    assert math.isfinite(out["share"])
    print_table(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
