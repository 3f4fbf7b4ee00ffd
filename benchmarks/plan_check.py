"""The ``auto`` planner's one-GPU prediction against a measured run: profile, plan, run, compare.

1. ``gem-train profile`` of the config on one GPU (the step-time, MFU and sequences sections): the
   measured kernel times per kind that calibrate the cost model (``gem_parallel.step_model``);
2. ``gem-train plan --world-size 1`` (and the ``--scale`` world sizes, for the record) with
   ``parallel.planner=auto`` and that profile: the chosen layout, the predicted step time and the
   predicted scaling efficiency;
3. measured runs of the same config on one GPU, ``trainer.steps`` steps each: under ``auto`` (what
   the plan chose) and under the config's own planner; their median step time after ``--warmup`` steps;
4. a table of the predictions against the measurements, and everything as JSON.

On the H200 (packages on PYTHONPATH, GEM_PLUGINS naming their plugin modules, as
``benchmarks/profile_tune_h200.sh``), each stage fits one 10-minute command::

    python benchmarks/plan_check.py --out /tmp/pc --stage profile    # ~2 min
    python benchmarks/plan_check.py --out /tmp/pc --stage plan       # < 1 min
    python benchmarks/plan_check.py --out /tmp/pc --stage measure    # ~3-4 min: two runs of 40 steps
    python benchmarks/plan_check.py --out /tmp/pc --stage report     # the table; plan_check.json
    python benchmarks/plan_check.py --out /tmp/pc                    # all four in a row

A CPU smoke test: ``python benchmarks/plan_check.py --config configs/tiny.yaml --device cpu --steps 8
--out /tmp/pc-cpu`` (the tiny config's planner, ``single``, cannot launch under torchrun; pass
``--set parallel.planner=torchrec_ddp`` for the reference run).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

PLUGINS = "gem_kernels.plugin,gem_precision.plugin,gem_parallel.plugin,gem_comm.plugin"


def sh(cmd: list[str], log: Path, timeout: int) -> tuple[int, float]:
    """Run ``cmd`` with its output in ``log``; (exit status, seconds)."""
    print(f"$ {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=os.environ.copy()).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    seconds = time.perf_counter() - start
    print(f"  exit {rc} in {seconds:.0f} s (log: {log})", flush=True)
    return rc, seconds


def gem(*args: str, torchrun: bool = False) -> list[str]:
    if torchrun:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m", "gem_model", *args]
    return [sys.executable, "-m", "gem_model", *args]


def base(args: argparse.Namespace) -> list[str]:
    out = ["-c", args.config, f"trainer.device={args.device}"]
    return out + [s for item in args.set for s in item.split(",") if s]


def auto(args: argparse.Namespace) -> list[str]:
    return ["parallel.planner=auto", f"parallel.planner.options.profile={args.out / 'profile'}"]


def stage_profile(args: argparse.Namespace, state: dict) -> None:
    rc, secs = sh(gem("profile", *base(args), "--out", str(args.out / "profile"), "--batches", "8", "--warmup",
                      str(args.warmup), "--steps", "3", "--sections", "sequences,step_time,mfu", torchrun=True),
                  args.out / "profile.log", 560)  # fmt: skip
    state["profile"] = {"exit": rc, "seconds": secs, "path": str(args.out / "profile" / "profile.json")}


def stage_plan(args: argparse.Namespace, state: dict) -> None:
    state["plans"] = {}
    for world in [1, *args.scale]:
        rc, secs = sh(gem("plan", *base(args), *auto(args), "--world-size", str(world), "--gpus-per-node",
                          str(min(world, args.gpus_per_node)), "--json"), args.out / f"plan-{world}.log", 560)  # fmt: skip
        entry: dict = {"exit": rc, "seconds": secs}
        if rc == 0:
            text = (args.out / f"plan-{world}.log").read_text()
            plan = json.loads(text[text.index("{"):])
            entry.update(layout=plan["layout"], prediction=plan["prediction"], notes=plan["notes"])
        state["plans"][str(world)] = entry


def measured_step(metrics: Path, warmup: int) -> dict:
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"step_seconds"' in line]
    after = [r["step_seconds"] for r in steps if r["step"] > warmup]
    return {"steps": len(steps), "median_step_seconds": statistics.median(after) if after else None,
            "mean_step_seconds": statistics.fmean(after) if after else None, "tokens_per_s":
            statistics.median(r["tokens_per_s"] for r in steps if r["step"] > warmup) if after else None}  # fmt: skip


def stage_measure(args: argparse.Namespace, state: dict) -> None:
    state["measured"] = {}
    runs = {"auto": auto(args), "config_planner": []}
    own = dict(x.split("=", 1) for x in args.steps_for)
    for name, extra in runs.items():
        out = args.out / f"run-{name}"
        steps = int(own.get(name, args.steps))
        rc, secs = sh(gem("run", *base(args), *extra, f"trainer.steps={steps}", "trainer.log_every=1",
                          f"trainer.output_dir={out}", "trainer.resume=false", "trainer.checkpoint_at_end=false",
                          "trainer.eval_at_end=false", "trainer.progress=false", torchrun=True),
                      args.out / f"run-{name}.log", 560)  # fmt: skip
        entry: dict = {"exit": rc, "seconds": secs}
        if (out / "metrics.jsonl").is_file():
            entry.update(measured_step(out / "metrics.jsonl", args.warmup))
        state["measured"][name] = entry


def report(state: dict) -> None:
    one = state.get("plans", {}).get("1", {}).get("prediction", {})
    predicted = one.get("step_seconds")
    print(f"\n{'':<34}{'step ms':>10}{'tokens/s':>14}{'vs predicted':>14}")
    if predicted:
        print(f"{'predicted, 1 GPU (auto)':<34}{1e3 * predicted:>10.1f}{one.get('tokens_per_s', 0):>14,.0f}{'':>14}")
    for name, m in state.get("measured", {}).items():
        if m.get("median_step_seconds"):
            ratio = f"{m['median_step_seconds'] / predicted:.3f}x" if predicted else "-"
            print(f"{'measured, ' + name:<34}{1e3 * m['median_step_seconds']:>10.1f}{m['tokens_per_s']:>14,.0f}{ratio:>14}")
        else:
            print(f"{'measured, ' + name:<34}{'failed (exit ' + str(m.get('exit')) + ')':>24}")
    for world, p in sorted(state.get("plans", {}).items(), key=lambda kv: int(kv[0])):
        pred = p.get("prediction") or {}
        if pred.get("step_seconds"):
            print(f"predicted on {world:>4} GPU(s): {p['layout']['degrees']}, step {1e3 * pred['step_seconds']:.1f} ms, "
                  f"scaling efficiency {100 * pred['scaling_efficiency']:.1f} %")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/h200-large.yaml")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stage", choices=["all", "profile", "plan", "measure", "report"], default="all")
    p.add_argument("--steps", type=int, default=40, help="steps of each measured run")
    p.add_argument("--steps-for", action="append", default=[], metavar="RUN=N",
                   help="steps of one measured run (auto or config_planner), e.g. config_planner=300 to make it "
                   "the config's stability run too")
    p.add_argument("--warmup", type=int, default=10, help="steps left out of the measured median (and the profile's warm-up)")
    p.add_argument("--scale", type=lambda s: [int(x) for x in s.split(",") if x], default=[8, 64],
                   help="world sizes to predict besides 1 (no measurement)")  # fmt: skip
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--set", action="append", default=[], help="config overrides for every stage, comma-separated")
    args = p.parse_args()
    os.environ.setdefault("GEM_PLUGINS", PLUGINS)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "plan_check.json"
    state = json.loads(path.read_text()) if path.is_file() else {}
    state.update(config=args.config, device=args.device, host=platform.node(), overrides=args.set,
                 date=datetime.date.today().isoformat())  # fmt: skip
    stages = ["profile", "plan", "measure"] if args.stage == "all" else [args.stage] if args.stage != "report" else []
    for stage in stages:
        {"profile": stage_profile, "plan": stage_plan, "measure": stage_measure}[stage](args, state)
        path.write_text(json.dumps(state, indent=1))
    report(state)
    path.write_text(json.dumps(state, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
