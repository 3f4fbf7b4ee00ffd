"""End-to-end training speed of one GEM config on one GPU, as an ablation: each row adds one thing.

    python benchmarks/e2e.py --out e2e.json                       # the whole ablation on configs/h200-large.yaml
    python benchmarks/e2e.py --rows bf16_activations,fp8_rowwise --steps 12 --profile bf16_activations,fp8_rowwise
    python benchmarks/e2e.py --stability 300 --out stab.json      # bf16 and fp8_rowwise, every step's loss
    python benchmarks/e2e.py --config configs/tiny.yaml --device cpu --steps 4 --set ... # smoke test

Every row runs in its own process under ``torchrun --nproc-per-node 1`` (the big config's tables use
torchrec's fused kernels, which need a process group; a fresh process also gives each row its own
peak memory). A row reports its step time, tokens/s and MFU over the steps after the first
``--warmup`` (Triton tuning and compilation), MFU both against the datasheet peak (989 TFLOP/s for an
H100/H200 in bf16, dense) and against a bf16 8192^3 matmul measured here first, the peak memory
allocated, and the loss at the last step. FLOPs are ``gem_model.model.flops`` (real tokens, the HSTU
mask's causal pairs, backward twice the forward), the trainer's own count.

``compile_bf16`` and ``compile_fp8`` are side rows, outside the chain (whose ``compile`` row adds
``trainer.compile`` to ``fp8_saved``): ``overlapped_input`` and ``fp8_rowwise`` plus ``trainer.compile``.

``--profile ROWS`` records two steps of each of those rows with ``torch.profiler`` and prints the kernels with
the most device time, their share of the step, and the step's device-idle share (wall time of the
profiled steps minus the union of kernel intervals).
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
from pathlib import Path

import torch
from profiling import device_events, device_idle, top_kernels  # benchmarks/profiling.py, beside this script

from gem_model import hookimpl

DATASHEET_BF16 = 989e12
BASELINE = [  # the state before the efficiency work, as options of today's code
    "kernels.jagged_attention=torch",
    "kernels.norm_gate=torch",
    "precision.activation_dtype=float32",
    "trainer.prefetch=0",
]
# The bucketed next-item loss (gem_model.model.next_item) replaced the padded one outright, so it is in
# every row; its own before/after is benchmarks/next_item_loss.py (benchmarks/results/next_item_loss.md).
ROWS: list[tuple[str, list[str]]] = [  # cumulative: each row is the one above plus its own overrides
    ("torch_attention_fp32", []),
    ("triton_attention", ["kernels.jagged_attention=triton", "kernels.norm_gate=triton"]),
    ("bf16_activations", ["precision.activation_dtype=auto"]),
    ("overlapped_input", ["trainer.prefetch=2"]),
    ("fp8_rowwise", ["precision.scheme=fp8_rowwise"]),
    ("fp8_saved", ["activation.policy=fp8_saved"]),
    ("compile", ["trainer.compile=true"]),
]
SIDE_ROWS: dict[str, tuple[str, list[str]]] = {  # not in the cumulative chain: (the row it adds to, its overrides)
    "compile_bf16": ("overlapped_input", ["trainer.compile=true"]),  # compile on the best bf16 row
    "compile_fp8": ("fp8_rowwise", ["trainer.compile=true"]),  # compile on fp8 GEMMs without fp8_saved
}
SLOW_ROWS = {"torch_attention_fp32", "triton_attention"}  # seconds per step: fewer steps


def row_overrides(name: str) -> list[str]:
    names = [n for n, _ in ROWS]
    if name in SIDE_ROWS:
        base, extra = SIDE_ROWS[name]
        return row_overrides(base) + extra
    if name not in names:
        raise SystemExit(f"unknown row {name!r}; rows: {', '.join([*names, *SIDE_ROWS])}")
    out = list(BASELINE)
    for _, extra in ROWS[: names.index(name) + 1]:
        out += extra
    return out


# ------------------------------------------------------------------------------------------ worker


class StepProfiler:
    """Wraps ``gem_train_step`` to record steps ``wait+1 .. wait+active`` with torch.profiler."""

    def __init__(self, wait: int, active: int):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=wait, warmup=1, active=active, repeat=1)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule)
        self.active = active

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        result = yield
        self.prof.step()
        return result

    def summary(self, limit: int = 20) -> dict:
        events = device_events(self.prof)
        idle = device_idle(events)
        window = idle.get("window_ms", 0.0)
        kernels = top_kernels(events, self.active, limit)
        for k in kernels:
            k["share"] = k["ms_per_step"] * self.active / window if window else None
        return {
            "profiled_steps": self.active,
            "step_wall_ms": window / max(self.active, 1),
            "device_busy_ms": idle.get("busy_ms", 0.0) / max(self.active, 1),
            "device_idle_share": idle.get("idle_share"),
            "top_kernels": kernels,
        }


def worker(args: argparse.Namespace) -> None:
    from gem_model.config_io import load_config
    from gem_model.plugins import GemPluginManager
    from gem_model.trainer import train

    overrides = [*row_overrides(args.row), *args.set, f"trainer.device={args.device}", "trainer.progress=false",
                 "trainer.checkpoint_at_end=false", "trainer.eval_at_end=false", f"trainer.steps={args.steps}",
                 f"trainer.output_dir={args.workdir}/{args.row}", "trainer.log_every=1"]  # fmt: skip
    config = load_config(args.config, overrides)
    pm = GemPluginManager()
    profiler = None
    if args.profile:
        profiler = StepProfiler(wait=max(args.warmup - 1, 0), active=2)
        pm.register(profiler, name="e2e-profiler")
    if profiler is not None:
        with profiler.prof:
            summary = train(config, pm)
    else:
        summary = train(config, pm)
    # each row its own directory: a shared metrics.jsonl would mix the rows' steps
    records = [json.loads(x) for x in (Path(args.workdir) / args.row / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step_loss" in r]
    skip = args.warmup + (3 if args.profile else 0)  # the profiled steps (and the one after) run slower
    timed = [r for r in steps if r["step"] > skip]
    seconds = sum(r["step_seconds"] for r in timed)
    tokens = sum(r["tokens_per_s"] * r["step_seconds"] for r in timed)
    flops = sum(r["mfu"] * summary.peak_flops * summary.world_size * r["step_seconds"] for r in timed)
    out = {
        "row": args.row,
        "ok": True,
        "overrides": overrides,
        "steps_timed": len(timed),
        "step_ms": 1e3 * seconds / max(len(timed), 1),
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "tflops_per_s": flops / seconds / 1e12 if seconds else 0.0,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        "first_loss": steps[0]["step_loss"],
        "last_loss": steps[-1]["step_loss"],
        "max_loss": max(r["step_loss"] for r in steps),
        "losses": [r["step_loss"] for r in steps],
        # every step's seconds, so that rows compare step by step (each row draws the same batches) and
        # steps that tuned or compiled Triton kernels for a new length bucket show as outliers
        "step_seconds": [r["step_seconds"] for r in steps],
        "step_ms_median": 1e3 * statistics.median(r["step_seconds"] for r in timed) if timed else 0.0,
        "plan": summary.extra.get("plan", "")[:200],
    }
    if profiler is not None:
        out["profile"] = profiler.summary()
    Path(args.result).write_text(json.dumps(out))


# ------------------------------------------------------------------------------------ orchestrator


def matmul_peak(device: str) -> float | None:
    """bf16 8192^3 matmul FLOP/s on this GPU (checked against an fp32 product first), or None on CPU."""
    if device != "cuda" or not torch.cuda.is_available():
        return None
    import triton.testing

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ref = a[:256].float() @ b.float()
    err = ((a[:256] @ b).float() - ref).abs().max() / ref.abs().max()
    if err > 1e-2:
        raise RuntimeError(f"bf16 matmul differs from fp32 by {float(err):.3g}")
    ms = triton.testing.do_bench(lambda: a @ b, warmup=50, rep=300)
    return 2 * 8192**3 / (ms * 1e-3)


def run_row(args: argparse.Namespace, row: str, *, steps: int, profile: bool, workdir: str) -> dict:
    result = Path(workdir) / f"{row}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", __file__, "--worker",
           "--row", row, "--config", args.config, "--device", args.device, "--steps", str(steps),
           "--warmup", str(args.warmup), "--workdir", workdir, "--result", str(result)]  # fmt: skip
    cmd += [a for s in args.set for a in ("--set", s)]
    if profile:
        cmd += ["--profile", row]
    # Output goes to files, not pipes: a worker left running cannot then block the reading. On a
    # timeout torchrun is asked to stop its worker (SIGTERM), then everything naming this row's
    # result file is killed: a stray worker would keep the GPU's memory for the next rows.
    log = Path(workdir) / f"{row}.log"
    with open(log, "w") as out, subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True) as p:
        try:
            p.wait(timeout=args.row_timeout)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
            subprocess.run(["pkill", "-9", "-f", str(result)], check=False)
            return {"row": row, "ok": False, "error": f"timed out after {args.row_timeout} s (--row-timeout)"}
    text = log.read_text()
    if p.returncode != 0 or not result.exists():
        worker_lines = [x for x in text.splitlines() if x.startswith("[rank0]:")]  # the worker's own traceback
        print(f"--- {row} failed (exit {p.returncode}):\n" + "\n".join(worker_lines[-25:] or text.splitlines()[-25:]), flush=True)
        errors = [x for x in worker_lines if "Error" in x] or [x for x in text.splitlines() if "Error" in x]
        return {"row": row, "ok": False, "error": (errors[-1] if errors else text[-300:]).removeprefix("[rank0]: ")[:400]}
    return json.loads(result.read_text())


def print_table(rows: list[dict], peak: float | None) -> None:
    print(f"\n{'row':<22} {'step ms':>9} {'tokens/s':>11} {'MFU 989':>8} {'MFU meas':>9} {'peak GiB':>9} {'loss last':>10}")
    for r in rows:
        if not r["ok"]:
            print(f"{r['row']:<22} FAILED: {r['error']}")
            continue
        meas = f"{100 * r['tflops_per_s'] * 1e12 / peak:8.2f}%" if peak else "       -"
        print(f"{r['row']:<22} {r['step_ms']:>9.1f} {r['tokens_per_s']:>11,.0f} {100 * r['tflops_per_s'] * 1e12 / DATASHEET_BF16:>7.2f}% "
              f"{meas} {r['peak_mem_gib']:>9.1f} {r['last_loss']:>10.4f}")
    for r in rows:
        prof = r.get("profile") if r["ok"] else None
        if prof:
            print(f"\nprofile of {r['row']}: {prof['step_wall_ms']:.1f} ms per step, device busy {prof['device_busy_ms']:.1f} ms, "
                  f"idle {100 * (prof['device_idle_share'] or 0):.1f} %")
            for k in prof["top_kernels"]:
                print(f"  {k['ms_per_step']:8.2f} ms {100 * (k['share'] or 0):5.1f} %  {k['kernel'][:100]}")


def write(path: str | None, args: argparse.Namespace, peak: float | None, rows: list[dict]) -> None:
    if not path:
        return
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__, "command": " ".join(shlex.quote(a) for a in sys.argv), "config": args.config,
        "datasheet_bf16_flops": DATASHEET_BF16, "measured_bf16_matmul_flops": peak,
    }  # fmt: skip
    Path(path).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/h200-large.yaml")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", default=",".join(n for n, _ in ROWS))
    p.add_argument("--steps", type=int, default=12, help="steps per row (the slow fp32 rows take 4)")
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the rates")
    p.add_argument("--profile", metavar="ROWS", default="", help="record two steps of these rows (comma-separated)")
    p.add_argument("--stability", type=int, metavar="STEPS", help="instead: train bf16 and fp8_rowwise this long")
    p.add_argument("--set", action="append", default=[], help="an override for every row (key=value)")
    p.add_argument("--steps-for", action="append", default=[], metavar="ROW=N", help="this row's own step count")
    p.add_argument("--row-timeout", type=int, default=900)
    p.add_argument("--out")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--row", help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    peak = matmul_peak(args.device)
    if peak:
        print(f"measured bf16 8192^3 matmul: {peak / 1e12:.0f} TFLOP/s", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as workdir:
        if args.stability:
            plan = [(name, args.stability, False) for name in ("overlapped_input", "fp8_rowwise")]
        else:
            names = args.rows.split(",")
            own = {k: int(v) for k, v in (x.split("=", 1) for x in args.steps_for)}
            default = {n: min(args.steps, args.warmup + 2) if n in SLOW_ROWS else args.steps for n in names}
            profiled = set(args.profile.split(",")) - {""}
            plan = [(n, own.get(n, default[n]), n in profiled) for n in names]
        for name, steps, profile in plan:
            rows.append(run_row(args, name, steps=steps, profile=profile, workdir=workdir))
            r = rows[-1]
            if r["ok"]:
                print(f"{name}: {r['step_ms']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
                      f"{100 * r['tflops_per_s'] * 1e12 / DATASHEET_BF16:.2f} % MFU, {r['peak_mem_gib']:.1f} GiB, "
                      f"loss {r['first_loss']:.4f} -> {r['last_loss']:.4f} (max {r['max_loss']:.4f})", flush=True)
            write(args.out, args, peak, rows)
    print_table(rows, peak)
    for r in rows:  # stable training (loss falls, no step above the first) for rows long enough to say
        if r["ok"] and len(r["losses"]) >= 100:
            window = max(len(r["losses"]) // 10, 1)
            falls = sum(r["losses"][-window:]) / window < sum(r["losses"][:window]) / window
            bounded = r["max_loss"] <= r["first_loss"]
            print(f"{r['row']}: loss falls {falls}, no step above the first {bounded}")
            r.update(stable_falls=falls, stable_bounded=bounded)
    write(args.out, args, peak, rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    sys.exit(main())
