"""The id range check's cost per batch against the step time (issue 17, requirement 6: ids out of
range give the same clear error on the GPU, before the lookup, at no more than 2 % step overhead).

Where the check runs: ``ShardedLoader.batch_at`` validates every batch it builds
(:func:`gem_model.data.validation.validate_batch`; the id range part is
:func:`~gem_model.data.validation.check_feature_ids`: min and max of each sparse feature's ids
against its table's rows) on the host batch, before its copy to the device, so a GPU run reports
an id out of range exactly as a CPU run does, before any lookup. With ``trainer.prefetch >= 1``
(the default, 2) the batch is built and validated on the prefetch thread
(:mod:`gem_model.data.prefetch`) while earlier steps run: off the step's critical path as long as
that thread keeps ahead of the step (torch's min/max release the GIL while they run). With
``trainer.prefetch=0`` it runs inside the step, on the critical path: the share printed is then
the step overhead itself.

The issue gives no way to switch the check off, and none is added, so the check is not timed as a
trainer run with it on against one with it off: the check functions themselves are timed on the
real batches of the config (its data source and balancer, this data-parallel rank's share, as
``ShardedLoader`` builds them), each ``--repeats`` times (the median kept), and reported as a
share of the step time. The step time is ``--step-ms`` when given; otherwise the trainer runs
``--measure-steps`` steps of the same config in this process and the median ``step_seconds`` of
its metrics after ``--skip-steps`` is taken. Also reported: the host time to build the batch (the
rest of the prefetch thread's work per step) and the whole validation.

On one H200 (the big config's tables use torchrec's fused kernels, which need a process group, so
through torchrun with one process; ~2 min of table build, Triton tuning and 30 steps)::

    torchrun --standalone --nproc-per-node 1 benchmarks/id_check.py -c configs/h200-large.yaml \\
        --measure-steps 30 --out benchmarks/results/raw/id_check_h200.json

On the CPU, a smoke run on the tiny config (``tests/test_id_check_bench.py`` runs this)::

    python benchmarks/id_check.py -c configs/tiny.yaml --device cpu --batches 3 --measure-steps 4 --out ids.json
"""

from __future__ import annotations

import argparse
import datetime
import json
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
from gem_model.data.batch import Batch
from gem_model.data.loader import ShardedLoader
from gem_model.data.validation import check_feature_ids, validate_batch
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components

BUDGET = 0.02  # the bound on the check's share of a step


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def time_checks(config: RunConfig, pm: GemPluginManager, args: argparse.Namespace) -> list[dict]:
    """Per batch: its ids, the build, the id range check and the whole validation, in host milliseconds."""
    components = resolve_components(config, pm)
    loader = ShardedLoader(components.source, components.balancer, global_batch_size=config.data.global_batch_size,
                           rank=args.rank, world_size=args.world_size, validate=False)  # fmt: skip
    spec = loader.spec
    rows = []
    for step in range(args.from_step, args.from_step + args.batches):
        start = time.perf_counter()
        batch: Batch = loader.batch_at(step)
        build_ms = 1e3 * (time.perf_counter() - start)

        def ids(batch: Batch = batch) -> None:
            check_feature_ids(batch.sequence.to_dict(), spec)
            check_feature_ids(batch.pooled.to_dict(), spec)

        ids()  # a bad id stops the benchmark as it would stop the run
        rows.append({
            "data_step": step,
            "samples": batch.batch_size,
            "ids": int(batch.sequence.values().numel() + batch.pooled.values().numel()),
            "build_ms": build_ms,
            "id_check_ms": median_ms(ids, args.repeats),
            "validate_ms": median_ms(lambda batch=batch: validate_batch(batch, spec), args.repeats),
        })  # fmt: skip
    return rows


def measure_step_ms(config_path: str | None, overrides: list[str], pm: GemPluginManager, args: argparse.Namespace) -> float:
    """The median step time of ``--measure-steps`` trainer steps of the config (after ``--skip-steps``)."""
    from gem_model.trainer import train

    with tempfile.TemporaryDirectory(prefix="gem-id-check-") as workdir:
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


def summarise(rows: list[dict], step_ms: float, step_source: str, config: RunConfig, argv: list[str]) -> dict:
    mean = {k: statistics.fmean(r[k] for r in rows) for k in ("ids", "build_ms", "id_check_ms", "validate_ms")}
    worst = max(r["id_check_ms"] for r in rows)
    prefetch = config.trainer.prefetch
    return {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if config.trainer.device == "cuda" and torch.cuda.is_available() else "cpu",
            "host": platform.processor() or platform.machine(),
            "command": shlex.join([sys.executable, *sys.argv[:1], *argv]),
            "config": config.name,
            "global_batch_size": config.data.global_batch_size,
            "trainer_prefetch": prefetch,
            "where": "the prefetch thread, off the step's critical path" if prefetch else "inside the step (trainer.prefetch=0)",
        },
        "batches": rows,
        "step_ms": step_ms,
        "step_ms_from": step_source,
        "mean": mean,
        "id_check_share": mean["id_check_ms"] / step_ms,
        "worst_id_check_share": worst / step_ms,
        "validate_share": mean["validate_ms"] / step_ms,
        "budget": BUDGET,
        "within_budget": worst / step_ms <= BUDGET,
    }


def print_table(out: dict) -> None:
    m = out["meta"]
    print(f"\n{m['config']}: {m['global_batch_size']} samples per global batch, the check runs on {m['where']}")
    print(f"{'data step':>9} {'ids':>10} {'build ms':>9} {'id check ms':>12} {'validate ms':>12}")
    for r in out["batches"]:
        print(f"{r['data_step']:>9} {r['ids']:>10} {r['build_ms']:>9.2f} {r['id_check_ms']:>12.3f} {r['validate_ms']:>12.3f}")
    print(
        f"step {out['step_ms']:.1f} ms ({out['step_ms_from']}): the id check is {100 * out['id_check_share']:.3f} % of it "
        f"(worst batch {100 * out['worst_id_check_share']:.3f} %), the whole validation "
        f"{100 * out['validate_share']:.3f} %; budget {100 * out['budget']:g} %: "
        f"{'within' if out['within_budget'] else 'OVER'}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", default="configs/h200-large.yaml")
    p.add_argument("--device", default=None, help="trainer.device (default: the config's)")
    p.add_argument("--batches", type=int, default=10, help="batches whose checks are timed")
    p.add_argument("--from-step", type=int, default=0, help="the data step of the first of them")
    p.add_argument("--repeats", type=int, default=5, help="timings of each check per batch (the median kept)")
    p.add_argument("--rank", type=int, default=0, help="the data-parallel rank whose share is built")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel ranks the global batch is split over")
    p.add_argument("--step-ms", type=float, default=None, help="the step time; without it the trainer measures it")
    p.add_argument("--measure-steps", type=int, default=30, help="trainer steps run to measure the step time")
    p.add_argument("--skip-steps", type=int, default=None, help="first steps left out (default: a third)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)
    if args.batches < 1 or args.repeats < 1 or args.measure_steps < 1 or not 0 <= args.rank < args.world_size:
        p.error("--batches, --repeats and --measure-steps must be at least 1, --rank in [0, --world-size)")
    if args.skip_steps is None:
        args.skip_steps = args.measure_steps // 3
    overrides = [*([f"trainer.device={args.device}"] if args.device else []), *args.set]
    config = load_config(args.config, overrides)
    pm = GemPluginManager()
    rows = time_checks(config, pm, args)
    if args.step_ms is not None:
        step_ms, source = args.step_ms, "given"
    else:
        step_ms = measure_step_ms(args.config, overrides, pm, args)
        source = f"median of trainer steps {args.skip_steps + 1}..{args.measure_steps}"
    out = summarise(rows, step_ms, source, config, argv)
    print_table(out)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
