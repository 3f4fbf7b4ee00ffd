"""End-to-end training throughput of the GEM model, one run per precision scheme / activation policy.

Runs the real trainer (``gem_model.trainer.train``) in this process for each variant and prints a
table of tokens/s, samples/s, MFU and the loss, and writes JSON. Each variant first trains a few
steps; the rates leave out the first two (warm-up, Triton compilation).

    python benchmarks/train_h200.py --out results.json [--steps 30] [--variants bf16,fp8_rowwise]
    python benchmarks/train_h200.py --config configs/tiny.yaml --device cpu --steps 5   # smoke test
    python benchmarks/train_h200.py --steps 8 --variants bf16 --profile bf16 --out prof.json

``--profile VARIANT`` records that variant's steps 4.. with ``torch.profiler`` (through a plugin
that wraps the ``gem_train_step`` hook) and prints the ops with the most self time, plus the
recorded steps' wall time against the time device kernels were busy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import shlex
import sys
import time
import traceback

import torch

from gem_model import hookimpl
from gem_model.config_io import load_config
from gem_model.plugins import GemPluginManager
from gem_model.trainer import train

VARIANTS: dict[str, list[str]] = {
    "fp32": ["precision.scheme=fp32"],
    "bf16": ["precision.scheme=bf16"],
    # bf16 linears that also return bf16: q, k, v reach the attention in bf16 instead of float32
    # (with float32 inputs the Triton attention computes in IEEE fp32, without tensor cores)
    "bf16_out": ["precision.scheme=bf16", "precision.scheme.options.output_dtype=bfloat16"],
    "fp8_tensorwise": ["precision.scheme=fp8_tensorwise"],
    "fp8_rowwise": ["precision.scheme=fp8_rowwise"],
    "mxfp8": ["precision.scheme=mxfp8"],
    "bf16+checkpoint_selective": ["precision.scheme=bf16", "activation.policy=checkpoint_selective"],
    "bf16+fp8_saved": ["precision.scheme=bf16", "activation.policy=fp8_saved"],
    "bf16+torch_attention": ["precision.scheme=bf16", "kernels.jagged_attention=torch", "kernels.norm_gate=torch"],
}


class StepProfiler:
    """A plugin that wraps ``gem_train_step`` to advance a ``torch.profiler`` schedule each step: it
    skips the first ``wait`` steps (tuning, compilation), then records ``active`` steps."""

    def __init__(self, wait: int, active: int):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        schedule = torch.profiler.schedule(wait=wait, warmup=1, active=active, repeat=1)
        self.prof = torch.profiler.profile(activities=activities, schedule=schedule)

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        result = yield
        self.prof.step()
        return result

    def busy(self) -> dict[str, float]:
        """Wall time of the recorded steps (the profiler's step spans) against the summed self time
        of all device kernels: the gap is time the device waited on the host."""
        events = self.prof.key_averages()
        steps = [e for e in events if e.key.startswith("ProfilerStep")]
        return {
            "steps_wall_ms": sum(e.cpu_time_total for e in steps) / 1e3,
            "device_busy_ms": sum(getattr(e, "self_device_time_total", 0.0) for e in events) / 1e3,
        }

    def top_ops(self, limit: int = 25) -> list[dict]:
        """The ops with the most self time (device time first where there is a device)."""
        key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        events = sorted(self.prof.key_averages(), key=lambda e: getattr(e, key, 0.0), reverse=True)
        return [
            {
                "op": e.key,
                "calls": e.count,
                "self_cpu_ms": e.self_cpu_time_total / 1e3,
                "self_device_ms": getattr(e, "self_device_time_total", 0.0) / 1e3,
            }
            for e in events[:limit]
        ]


def print_top_ops(variant: str, steps: int, ops: list[dict]) -> None:
    print(f"\n{variant}: ops with the most self time over {steps} profiled steps")
    print(f"{'op':<60} {'calls':>7} {'self CPU ms':>12} {'self device ms':>15}")
    for o in ops:
        print(f"{o['op'][:60]:<60} {o['calls']:>7} {o['self_cpu_ms']:>12.2f} {o['self_device_ms']:>15.2f}")


def write_json(path: str | None, config: str, rows: list[dict]) -> None:
    if not path:
        return
    meta = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__, "command": " ".join(shlex.quote(a) for a in sys.argv), "config": config,
    }  # fmt: skip
    with open(path, "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/h200.yaml")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", default=None)
    p.add_argument("--profile", metavar="VARIANT", help="record a torch.profiler trace of this variant's steps")
    p.add_argument("--profile-steps", type=int, default=3, help="steps recorded, after the first three")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    pm = GemPluginManager()
    rows = []
    for name in args.variants.split(","):
        overrides = [
            *VARIANTS[name], f"trainer.steps={args.steps}", f"trainer.device={args.device}", "trainer.progress=false",
            "trainer.checkpoint_at_end=false", f"trainer.output_dir=/tmp/gem-bench/{name}", f"trainer.log_every={args.steps}",
            *args.overrides,
        ]
        start = time.time()
        try:
            cfg = load_config(args.config, overrides)
            profiler = StepProfiler(wait=2, active=args.profile_steps) if name == args.profile else None
            if profiler is not None:
                if args.steps < 3 + args.profile_steps:
                    raise ValueError(f"--profile needs --steps >= {3 + args.profile_steps}")
                profiled = GemPluginManager()  # its own manager: the profiler sees this variant only
                profiled.register(profiler, name="step-profiler")
                with profiler.prof:
                    s = train(cfg, profiled)
            else:
                s = train(cfg, pm)
            peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0
            rows.append({
                "variant": name, "ok": True, "tokens_per_s": s.tokens_per_s, "samples_per_s": s.samples_per_s,
                "mfu": s.mfu, "peak_tflops": s.peak_flops / 1e12, "first_loss": s.first_loss, "last_loss": s.last_loss,
                "peak_mem_gib": peak, "wall_s": time.time() - start,
            })
            if profiler is not None:
                rows[-1]["profiled_steps"] = args.profile_steps
                rows[-1]["top_ops"] = profiler.top_ops()
                rows[-1].update(profiler.busy())
                print(f"profiled steps: {rows[-1]['steps_wall_ms']:.1f} ms wall, device kernels busy {rows[-1]['device_busy_ms']:.1f} ms")
                print_top_ops(name, args.profile_steps, rows[-1]["top_ops"])
        except Exception as exc:  # one failing variant must not hide the others
            traceback.print_exc()
            rows.append({"variant": name, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
        write_json(args.out, args.config, rows)  # after every variant: a run cut short keeps what it finished
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    print(f"\n{'variant':<28} {'tokens/s':>12} {'samples/s':>10} {'MFU %':>7} {'loss first->last':>18} {'mem GiB':>8}")
    for r in rows:
        if r["ok"]:
            print(f"{r['variant']:<28} {r['tokens_per_s']:>12,.0f} {r['samples_per_s']:>10,.0f} {100 * r['mfu']:>7.2f} "
                  f"{r['first_loss']:>8.3f}->{r['last_loss']:<8.3f} {r['peak_mem_gib']:>8.1f}")
        else:
            print(f"{r['variant']:<28} FAILED: {r['error']}")
    write_json(args.out, args.config, rows)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
