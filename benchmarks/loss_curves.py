"""Training runs of one config under several variants, the same seed and batches, compared by their losses.

What issue 30 asks of a precision variant ("the loss at step 300 within 1 % of bf16's") and issue 29
of the big config ("the loss falls, and no step exceeds the first"). Each variant is one
``gem-train run`` (under torchrun, ``--nproc`` processes) with its own config overrides, one after the
other; every variant reads the same batches (the data source's seed is the config's). Per variant:

* the loss at the last step, and the mean over the last ``--tail`` steps (one step's loss moves with
  its batch; the tail's mean is the figure to compare);
* its ratio to the first variant's, the largest loss after step 1 against step 1's;
* the median step time and MFU after the first 10 steps, as the trainer reports them (MFU against the
  peak of each variant's precision: an fp8 variant's is counted against the fp8 peak, twice bf16's).

    python benchmarks/loss_curves.py -c configs/h200-large.yaml --steps 300 \\
        --variant bf16= --variant fp8_rowwise=precision.scheme=fp8_rowwise --out losses.json
    python benchmarks/loss_curves.py -c configs/tiny.yaml --steps 6 --tail 3 --device cpu \\
        --variant a= --variant b=trainer.dense_lr=0.001          # a smoke test on the CPU
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``NAME=OVERRIDE[,OVERRIDE...]`` (an empty list: the config as it is)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant {text!r}: expected NAME=OVERRIDES (comma-separated key=value, or nothing)")
    return name, [o for o in rest.split(",") if o]


def run_variant(
    config: str, overrides: list[str], steps: int, device: str, workdir: Path, nproc: int
) -> tuple[list[dict], float]:
    out = workdir / "run"
    # through torchrun even for one process: the big config's planner (torchrec_ddp) needs a process group
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m",
           "gem_model", "run", "-c", config, *overrides,
           f"trainer.steps={steps}", "trainer.log_every=1", f"trainer.device={device}", f"trainer.output_dir={out}",
           "trainer.resume=false", "trainer.progress=false", "trainer.checkpoint_at_end=false",
           "trainer.eval_at_end=false"]  # fmt: skip
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"the run {shlex.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in records if "step_loss" in r], wall


def summarize(name: str, overrides: list[str], records: list[dict], wall: float, tail: int) -> dict:
    losses = [r["step_loss"] for r in records]
    after = records[10:] if len(records) > 20 else records
    return {
        "name": name,
        "overrides": overrides,
        "steps": len(losses),
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "tail_mean": statistics.fmean(losses[-tail:]),
        "max_after_first": max(losses[1:]) if len(losses) > 1 else losses[0],
        "median_step_ms": 1e3 * statistics.median(r["step_seconds"] for r in after),
        "median_mfu": statistics.median(r["mfu"] for r in after),
        "wall_s": wall,
        "losses": losses,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", required=True)
    p.add_argument("--variant", action="append", required=True,
                   help="NAME=OVERRIDE,OVERRIDE (the first is the reference)")  # fmt: skip
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tail", type=int, default=30, help="steps at the end whose mean loss is compared")
    p.add_argument("--device", default="cuda")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    rows = []
    for name, overrides in variants:
        with tempfile.TemporaryDirectory() as tmp:
            records, wall = run_variant(args.config, overrides, args.steps, args.device, Path(tmp), args.nproc)
        rows.append(summarize(name, overrides, records, wall, min(args.tail, len(records))))
        print(f"{name}: {len(records)} steps in {wall:.0f} s", flush=True)
    ref = rows[0]
    print(f"\n{'variant':<28} {'step 1':>8} {'last':>8} {f'mean last {args.tail}':>14} {'vs first':>9} "
          f"{'max after 1':>12} {'step ms':>8} {'MFU':>7}")  # fmt: skip
    for r in rows:
        r["tail_vs_reference"] = r["tail_mean"] / ref["tail_mean"]
        print(f"{r['name']:<28} {r['first_loss']:8.4f} {r['last_loss']:8.4f} {r['tail_mean']:14.4f} "
              f"{r['tail_vs_reference']:8.4f}x {r['max_after_first']:12.4f} {r['median_step_ms']:8.1f} "
              f"{100 * r['median_mfu']:6.2f}%")  # fmt: skip
    if args.out:
        meta = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
            "command": shlex.join([sys.executable, *sys.argv]),
            "config": args.config,
            "python": platform.python_version(),
            "host": platform.node(),
            "device": _device_name(args.device),
            "cwd": os.getcwd(),
        }
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def _device_name(device: str) -> str:
    if device != "cuda":
        return device
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda (not visible here)"


if __name__ == "__main__":
    main()
