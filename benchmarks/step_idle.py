"""How long the device waits for the host in a training step, and where the step's host syncs are.

Runs the real trainer in this process once per variant (``name:override,override,...``) and records,
through a plugin that wraps the ``gem_train_step`` hook, ``--profile-steps`` steps after
``--profile-from`` with ``torch.profiler``: the device-idle share is 1 - (union of the kernel and
copy intervals) / (first device activity to last) over those steps. With ``--syncs`` the same steps
run under ``torch.cuda.set_sync_debug_mode("warn")`` and every host sync is counted by the source
line that caused it (this slows the host: measure idle time without it). Variants run in one
process one after the other; the first also pays Triton's tuning and compilation, so put a
throw-away variant first when comparing.

    python benchmarks/step_idle.py --config configs/h200.yaml --out idle.json warm:trainer.prefetch=0 \\
        off:trainer.prefetch=0 on:trainer.prefetch=2
    torchrun --standalone --nproc-per-node 1 benchmarks/step_idle.py --config configs/h200-large.yaml --syncs on:
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
import warnings

import torch
from profiling import device_events, device_idle  # benchmarks/profiling.py, beside this script

from gem_model import hookimpl
from gem_model.config_io import load_config
from gem_model.plugins import GemPluginManager
from gem_model.trainer import train


class StepProbe:
    """Profiles steps ``first .. first + count - 1``; optionally counts their host syncs by source line."""

    def __init__(self, first: int, count: int, syncs: bool):
        self.first, self.count, self.check_syncs = first, count, syncs and torch.cuda.is_available()
        self.syncs: dict[str, int] = {}
        self.seconds: list[float] = []
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=first - 1, warmup=1, active=count, repeat=1)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule)

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        check = self.check_syncs and self.first <= step < self.first + self.count
        if check:
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = yield
        if check:
            torch.cuda.set_sync_debug_mode(0)
            for w in caught:
                if "synchroniz" in str(w.message):
                    where = f"{os.path.basename(w.filename)}:{w.lineno}"
                    self.syncs[where] = self.syncs.get(where, 0) + 1
        self.seconds.append(result.seconds)
        self.prof.step()
        return result


def run_variant(args: argparse.Namespace, name: str, overrides: list[str]) -> dict:
    probe = StepProbe(args.profile_from, args.profile_steps, args.syncs)
    pm = GemPluginManager()
    pm.register(probe, name="step-probe")
    out_dir = f"/tmp/gem-step-idle/{name}"
    cfg = load_config(args.config, [
        f"trainer.steps={args.steps}", "trainer.progress=false", "trainer.checkpoint_at_end=false",
        "trainer.eval_at_end=false", f"trainer.output_dir={out_dir}", "trainer.log_every=1", *overrides,
    ])  # fmt: skip
    start = time.time()
    probe.prof.start()
    try:
        summary = train(cfg, pm)
    finally:
        probe.prof.stop()
    with open(f"{out_dir}/metrics.jsonl") as fh:
        losses = [r["step_loss"] for r in map(json.loads, fh) if "step_loss" in r]
    return {
        "variant": name, "overrides": overrides, "wall_s": time.time() - start, "tokens_per_s": summary.tokens_per_s,
        "mfu": summary.mfu, "losses": losses, "step_seconds": probe.seconds,
        "syncs_per_step": {k: v / args.profile_steps for k, v in sorted(probe.syncs.items())},
        **device_idle(device_events(probe.prof)),
    }  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/h200.yaml")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--profile-from", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--syncs", action="store_true", help="count host syncs (slows the host; idle share inflated)")
    p.add_argument("--out", default=None)
    p.add_argument("variants", nargs="+", help="name:override,override,...")
    args = p.parse_args()
    if args.steps < args.profile_from + args.profile_steps:
        p.error("--steps must cover --profile-from + --profile-steps")
    rows: list[dict] = []
    for spec in args.variants:
        name, _, overrides = spec.partition(":")
        try:
            rows.append(run_variant(args, name, [o for o in overrides.split(",") if o]))
        except Exception as exc:  # one failing variant must not hide the others
            traceback.print_exc()
            rows.append({"variant": name, "error": f"{type(exc).__name__}: {exc}"[:300]})
        if args.out:
            with open(args.out, "w") as fh:
                json.dump(rows, fh, indent=1)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"\n{'variant':<12} {'tokens/s':>12} {'idle %':>7} {'busy ms/step':>13} {'median s/step':>14}  syncs/step")
    for r in rows:
        if "error" in r:
            print(f"{r['variant']:<12} FAILED: {r['error']}")
            continue
        idle = 100 * r["idle_share"] if "idle_share" in r else float("nan")
        busy = r.get("busy_ms", float("nan")) / args.profile_steps
        median = statistics.median(r["step_seconds"][2:])  # robust to the profiler's own slow steps
        syncs = ", ".join(f"{k} x{v:g}" for k, v in r["syncs_per_step"].items()) or "-"
        print(f"{r['variant']:<12} {r['tokens_per_s']:>12,.0f} {idle:>7.1f} {busy:>13.1f} {median:>14.4f}  {syncs}")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
