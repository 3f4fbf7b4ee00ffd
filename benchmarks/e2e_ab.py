"""Interleaved A/B timing of whole training steps: several variants of one run, in one process, on the
same batches, so that a few per cent can be resolved.

    torchrun --standalone --nproc-per-node 1 benchmarks/e2e_ab.py --config configs/h200-large.yaml \\
        --variants A=base,B=base,C=unfused --steps 60 --out ab.json
    python benchmarks/e2e_ab.py --config configs/tiny.yaml --device cpu --steps 4 --warmup 1   # smoke test

Why one process: `e2e.py` ran each row in its own process, one after the other, and the same row came
out up to 15 % apart by its place in the call (warm-up, clocks, the allocator's history). Here one
:class:`~gem_model.train.run.Run` is built once; a *variant* is a switch applied to that live run
between two steps (``VARIANTS`` below: compile the blocks, the dq mode of attention, the unfused
HSTU gap, ...), never a different model.

Protocol:
* The batches are drawn once. Every batch is trained once by every variant, in an order rotated per
  batch (A B C, B C A, C A B, ...), so no variant always runs first or after the same one.
* Warm-up: the first ``--warmup`` batches, plus one batch of each tuning bucket the timed batches
  meet (the Triton kernels tune per mean-length bucket), run every variant before timing starts.
* Per step: host wall time (from this step's start to the next step's start: the step's one host
  sync makes the host wait for the device, so in steady state this is the device's step time), and
  device time from CUDA events: the forward (to the loss) and the backward-and-update spans, whose
  sum is the device's work span without the wait at the loss check. Idle = wall - device.
* ``--steady N``: then N consecutive steps per variant without a sync between them (as training runs);
  ``--steady-rounds R`` repeats them R times in rotated order and compares the variants round by round;
  and with ``--profile-steady`` those steps again under the profiler for the profiled variants: their
  device-busy time on the same batches, against the unprofiled steady wall time (the idle of issue 29's
  requirement 4; the gaps inside profiled steps overstate it, the profiler slowing the host).
* Reported per variant: median and interquartile range of wall and device ms, tokens/s and MFU
  (our convention: backward twice the forward; NVIDIA's: attention backward 2.5x its forward) over
  the medians, peak memory. An A/A pair (the same variant under two names) shows the resolution.

What the orchestrator prints and writes of the worker's result is ``ab_report.py``'s, beside this script.

Every variant trains (each step is a real update), so the weights move on between the variants'
steps of one batch; the losses are reported for sanity, not compared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ab_report import (  # beside this script
    paired,
    print_steady,
    print_table,
    steady_against_first,
    steady_energy,
    summarize,
)
from ab_switches import VARIANTS  # beside this script
from profiling import print_profile, profile_steps  # beside this script
from step_measures import EventPipeline, GcPauses  # beside this script

from gem_model.profiling.device_power import POWER_FIELDS


@dataclass
class Row:
    name: str
    switches: list[str]
    wall_ms: list[float] = field(default_factory=list)
    device_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    flops: list[float] = field(default_factory=list)
    flops_nvidia: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    gc_ms: list[float] = field(default_factory=list)
    peak_gib: float = 0.0
    windows: list[tuple[float, float]] = field(default_factory=list)
    """``time.perf_counter()`` spans of the timed steps, for the power samples (``gem_model.profiling.device_power``)."""
    power: dict | None = None


def tuning_bucket(tokens: int, samples: int) -> int:
    """The mean-length bucket of the attention kernels' tuning key (``length_buckets``)."""
    mean = -(-tokens // max(1, samples))
    return max(16, 1 << max(0, mean - 1).bit_length())


def worker(args: argparse.Namespace) -> None:
    from gem_model.config_io import load_config
    from gem_model.model.flops import count_flops
    from gem_model.plugins import GemPluginManager
    from gem_model.profiling.device_power import sampler_for
    from gem_model.profiling.device_power import summarize as summarize_power
    from gem_model.train.collector import GcSchedule
    from gem_model.trainer import started_run

    names, rows = [], []
    for item in args.variants.split(","):
        name, _, spec = item.partition("=")
        switches = (spec or name).split("+")
        unknown = [s for s in switches if s not in VARIANTS]
        if unknown:
            raise SystemExit(f"--variants: unknown switch {unknown}; known: {', '.join(VARIANTS)}")
        names.append(name)
        rows.append(Row(name, switches))
    total = args.warmup + args.steps
    overrides = [*args.set, f"trainer.device={args.device}", "trainer.progress=false", "trainer.checkpoint_at_end=false",
                 "trainer.eval_at_end=false", f"trainer.steps={(total + 2 * args.steady * args.steady_rounds) * len(rows) + 64}",
                 f"trainer.output_dir={args.workdir}/ab", "trainer.log_every=1000000", "trainer.resume=false"]  # fmt: skip
    config = load_config(args.config, overrides)
    with started_run(config, GemPluginManager()) as run:
        device = run.env.device
        staged = [run.feed.get(s) for s in range(total)]
        batches = [s.ready() for s in staged]
        run._ab_batches = batches
        run.feed.close()
        nvidia = []
        for b in batches:
            counted = count_flops(config.model, run.spec, b.history_lengths().cpu())
            nvidia.append(counted.train_step + 0.5 * counted.hstu_attention)
        buckets: dict[int, int] = {}
        for i in range(args.warmup, total):
            buckets.setdefault(tuning_bucket(staged[i].facts.tokens, staged[i].facts.samples), i)
        warm = list(range(args.warmup)) + sorted(set(buckets.values()))
        pipeline = run.components.pipeline
        events = EventPipeline(pipeline, device)
        current: list[int] = [0]
        run.core_step.pipeline = events
        pipeline.next_batch = lambda step: staged[current[0]]  # every variant trains the same staged batch
        undo: list[Callable[[], None]] = []
        step = 0
        pauses = GcPauses()
        collector = GcSchedule(args.gc_every)  # trainer.gc_every's schedule, for the whole process
        collector.start()
        power = sampler_for(device, args.power_ms, args.power_field)

        def use(row: Row) -> None:
            for u in undo:
                u()
            undo.clear()
            for sw in row.switches:
                undo.append(VARIANTS[sw](run))

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def one(index: int, row: Row, timed: bool) -> None:
            """One step of ``row`` on batch ``index``, closed by a device sync, so that its wall time is
            its own (without it the host's clock would take in the previous variant's backward)."""
            nonlocal step
            use(row)
            current[0] = index
            if device.type == "cuda" and not timed:
                torch.cuda.reset_peak_memory_stats(device)
            gc0 = pauses.total_ms
            t0 = time.perf_counter()
            result = run.core_step(step)
            collector.after_step(step)
            step += 1
            sync()
            wall = time.perf_counter() - t0
            gc_ms = pauses.total_ms - gc0
            device_ms = events.take()
            if not timed:
                if device.type == "cuda":
                    row.peak_gib = max(row.peak_gib, torch.cuda.max_memory_allocated(device) / 2**30)
                return
            row.wall_ms.append(1e3 * wall)
            row.windows.append((t0, t0 + wall))
            row.device_ms.extend(device_ms)
            row.tokens.append(result.tokens)
            row.flops.append(result.flops)
            row.flops_nvidia.append(nvidia[index])
            row.losses.append(result.loss)
            row.gc_ms.append(gc_ms)

        t_warm = time.perf_counter()
        for index in warm:
            for row in rows:
                one(index, row, timed=False)
        print(f"warm-up: {len(warm)} batches x {len(rows)} variants in {time.perf_counter() - t_warm:.1f} s "
              f"(tuning buckets {sorted(buckets)})", flush=True)  # fmt: skip
        if power is not None:
            power.start()
        for k, index in enumerate(range(args.warmup, total)):
            for j in range(len(rows)):
                one(index, rows[(j + k) % len(rows)], timed=True)
        steady: dict[str, dict] = {}
        steady_batches = list(range(args.warmup, args.warmup + min(args.steady, args.steps)))

        def consecutive() -> None:
            """The steady batches in a row without a sync between them, as training runs (the host may
            run ahead, so idle here is what a real run sees; the A/B steps above each pay a restart)."""
            nonlocal step
            for index in steady_batches:
                current[0] = index
                run.core_step(step)
                collector.after_step(step)
                step += 1
            sync()

        # each round runs every variant's steady steps, the order rotated round by round (A B C, B C A, ...)
        for r in range(args.steady_rounds) if args.steady else ():
            for j in range(len(rows)):
                row = rows[(j + r) % len(rows)]
                use(row)
                sync()
                events.take()
                t0 = time.perf_counter()
                consecutive()
                wall = time.perf_counter() - t0
                spans = events.take()
                st = steady.setdefault(row.name, {"steps": len(spans), "rounds_wall_ms": [], "rounds_device_ms": [],
                                                  "windows": []})  # fmt: skip
                st["windows"].append((t0, t0 + wall))
                st["rounds_wall_ms"].append(1e3 * wall / len(spans))
                st["rounds_device_ms"].append(sum(spans) / len(spans))
        if power is not None:  # the timed and the steady steps are over: what the GPU drew during each variant's
            power.stop()
            for row in rows:
                row.power = summarize_power(power.within(row.windows))
            for st in steady.values():
                st["power"] = summarize_power(power.within(st["windows"]))
        for st in steady.values():  # the medians over the rounds
            st["wall_ms_per_step"] = statistics.median(st["rounds_wall_ms"])
            st["device_ms_per_step"] = statistics.median(st["rounds_device_ms"])
        for row in rows if args.steady and args.profile_steady else ():
            if row.name not in args.profile.split(","):
                continue
            # the same steps again, under the profiler: the device's busy time (merged kernel intervals)
            # on exactly the batches the steady wall time was taken on; the profiler slows the host, not
            # the kernels, so idle = 1 - busy / (the unprofiled steady wall)
            use(row)
            sync()
            prof = profile_steps(consecutive, steps=1)
            events.take()
            n = len(steady_batches)
            st = steady[row.name]
            st["busy_ms_per_step"] = prof["busy_ms_per_step"] / n
            st["idle_vs_busy"] = 1 - st["busy_ms_per_step"] / st["wall_ms_per_step"]
            st["categories_ms_per_step"] = {k: v / n for k, v in prof["categories_ms_per_step"].items()}
        syncs: dict[str, int] = {}
        if args.sync_debug and device.type == "cuda":
            # one step of the first variant with CUDA's sync debugging: every host sync warns, from the
            # Python line that caused it
            import warnings

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    one(args.warmup, rows[0], timed=False)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            for w in caught:
                if "synchroniz" in str(w.message):
                    site = f"{Path(w.filename).name}:{w.lineno}"
                    syncs[site] = syncs.get(site, 0) + 1
            print(f"host syncs in one step of {rows[0].name}: {sum(syncs.values())} {syncs}", flush=True)
        profile = {}
        for row in rows:
            if row.name in args.profile.split(","):
                profile[row.name] = profile_steps(lambda row=row: one(args.warmup, row, timed=False), steps=2)
        for u in undo:
            u()
        collector.stop()
        pauses.close()
        peak = run.peak
    result = {
        "rows": [r.__dict__ for r in rows],
        "peak_flops": peak,
        "warmup_batches": warm,
        "steady": steady,
        "profile": profile,
        "syncs": syncs,
        "power_failure": None if power is None else power.failure,
    }
    Path(args.result).write_text(json.dumps(result))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/h200-large.yaml")
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default="A=base,B=base", help=f"NAME=SWITCH[+SWITCH],...; switches: {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=60, help="timed batches; each variant trains each of them once")
    p.add_argument("--warmup", type=int, default=4, help="batches every variant trains before timing")
    p.add_argument("--steady", type=int, default=0, metavar="N",
                   help="then N consecutive steps per variant without a sync per step: the idle share a run sees")
    p.add_argument("--steady-rounds", type=int, default=1, metavar="R",
                   help="repeat the steady steps R times, the variants' order rotated each round; each variant's "
                   "steady figures are the medians over the rounds, compared with the first's round by round")
    p.add_argument("--sync-debug", action="store_true", help="list the host syncs of one step (CUDA)")
    p.add_argument("--profile", default="", metavar="VARIANTS", help="profile two steps of these variants")
    p.add_argument("--profile-steady", action="store_true",
                   help="with --steady: also profile the profiled variants' steady steps, for their device-busy "
                   "time on the same batches (idle = 1 - busy / steady wall)")
    p.add_argument("--set", action="append", default=[], help="a config override (key=value)")
    p.add_argument("--gc-every", type=int, default=0, metavar="N",
                   help="trainer.gc_every's schedule for the whole process (0: Python's own collection)")
    p.add_argument("--power-ms", type=int, default=100, metavar="MS",
                   help="sample the GPU's power draw and SM clock every MS ms by nvidia-smi during the timed and steady "
                   "steps (0: off)")
    p.add_argument("--power-field", default="power.draw.instant", choices=POWER_FIELDS,
                   help="nvidia-smi's power reading: the instantaneous one (default), or power.draw, which recent "
                   "drivers average over the last second: longer than one interleaved timed step")
    p.add_argument("--out")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steady_rounds < 1:
        p.error(f"--steady-rounds must be at least 1, got {args.steady_rounds}")
    if args.worker or "LOCAL_RANK" in os.environ:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            args.workdir = args.workdir or tmp
            args.result = args.result or os.path.join(tmp, "result.json")
            worker(args)
            raw = json.loads(Path(args.result).read_text())
        paired(raw["rows"])
        summary = [summarize(r, raw["peak_flops"]) for r in raw["rows"]]
        print_table(summary)
        if raw.get("power_failure"):
            print(f"power and clock not sampled: {raw['power_failure']}")
        for name, prof in raw["profile"].items():
            print_profile(name, prof)
        steady_against_first(raw["steady"])
        steady_energy(raw["steady"])
        print_steady(raw["steady"])
        if args.out:
            meta = {
                "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
                "torch": torch.__version__, "command": " ".join(shlex.quote(a) for a in sys.argv),
                "config": args.config, "set": args.set, "peak_flops": raw["peak_flops"],
                "warmup_batches": raw["warmup_batches"], "steady": raw["steady"], "profile": raw["profile"],
            }  # fmt: skip
            Path(args.out).write_text(json.dumps({"meta": meta, "summary": summary, "rows": raw["rows"]}, indent=1))
        return 0
    raise SystemExit("run it under torchrun (see the docstring), or with --worker for a single process")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    sys.exit(main())
