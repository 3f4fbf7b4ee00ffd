"""The attention backward's three ways to ``dq``, on the same inputs, interleaved.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/atomic_dq.py --rounds 15 --out atomic_dq.json
    TRITON_INTERPRET=1 ... python benchmarks/atomic_dq.py --smoke   # the checks on a tiny input, no timing

- ``separate``: the key-major pass for ``dk``, ``dv`` and a query-major pass for ``dq`` (recomputes ``s``
  and ``dp``: 7 MMAs per tile pair);
- ``atomic_rows``: ``dq = ds k`` in the key-major pass, added into a zeroed float32 buffer with atomics, then
  cast (5 MMAs; the fifth has the query step as M, 16-32 rows: ``mma.sync`` on Hopper);
- ``atomic_t``: the same with ``dq^T = k^T ds^T`` (M is the head dim: ``wgmma``).

Each variant is the whole backward of one layer (``attention_triton_autograd.attention_backward``: for the
atomic ones the buffer's zeroing and cast included). Inputs as ``attention_loads.py`` lays them out.
Before timing, every variant's ``dq``, ``dk``, ``dv`` are checked against ``separate``'s (relative
Frobenius error at most 1e-2: bf16 rounding and the atomics' order). Each variant tunes itself first;
then ``--rounds`` rounds in rotated order; medians and quartiles in ms, speed-up against ``separate``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_loads import make_inputs
from jagged_attention import CASES, Case
from rounds import cell, rotated_rounds, save_results, spread

from gem_kernels import attention_triton_bwd
from gem_kernels.attention_triton import DQ
from gem_kernels.attention_triton_autograd import attention_backward
from gem_kernels.attention_triton_bias import NO_BIAS
from gem_kernels.attention_triton_bwd import DKDV, DKDV_ATOMIC

VARIANTS = {"separate": ("separate", False), "atomic_rows": ("atomic", False), "atomic_t": ("atomic", True)}
TIMED_CASES = ("big_config", "fixed1024", "fixed4096")
SMOKE_CASE = Case(5, 2, 32, 70, 0.6, lengths="powerlaw")
EXTRA_CONFIGS = [(16, 128, 8, 2, 1), (16, 128, 8, 4, 1), (16, 64, 8, 4, 1)]
"""``--extra-configs``: key-major tiles that compile without spills with the transposed dq (sm_90)."""
SEED = 2027


def backward(case: Case, x: dict[str, Any], variant: str) -> Callable[[], tuple[torch.Tensor, ...]]:
    dq_mode, transposed = VARIANTS[variant]

    def run() -> tuple[torch.Tensor, ...]:
        before = attention_triton_bwd.TRANSPOSED_DQ
        attention_triton_bwd.TRANSPOSED_DQ = transposed
        try:
            dq, dk, dv, _, _ = attention_backward(
                x["grad"], x["q"], x["k"], x["v"], x["offsets"], x["targets"], NO_BIAS,
                max_seq_len=case.max_seq_len, alpha=1.0 / case.dim, max_attn_len=0, dq_mode=dq_mode, blocks=None,
                needs_position=False, needs_time=False,
            )
        finally:
            attention_triton_bwd.TRANSPOSED_DQ = before
        return dq, dk, dv

    return run


def check(case: Case, x: dict[str, Any]) -> dict[str, float]:
    """Every variant's gradients against ``separate``'s (relative Frobenius error); stops on a miss."""
    reference = backward(case, x, "separate")()
    report: dict[str, float] = {}
    for variant in VARIANTS:
        if variant == "separate":
            continue
        for name, a, b in zip(("dq", "dk", "dv"), backward(case, x, variant)(), reference, strict=True):
            if not bool(torch.isfinite(a).all()):
                raise SystemExit(f"{variant}: {name} not finite")
            err = ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()
            report[f"{variant}_{name}_rel_err"] = err
            if err > 1e-2:
                raise SystemExit(f"{variant}: {name} against separate's, relative error {err:.2e}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(TIMED_CASES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--extra-configs", action="store_true", help=f"also tune the key-major pass over {EXTRA_CONFIGS}")
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true", help="the checks on one tiny case (interpreter), no timing")
    args = parser.parse_args()
    if args.smoke:
        x = make_inputs(SMOKE_CASE, torch.device("cpu"), SEED)
        print(check(SMOKE_CASE, x))
        return 0
    if args.extra_configs:
        attention_triton_bwd.CONFIGS = [*attention_triton_bwd.CONFIGS, *EXTRA_CONFIGS]
    device = torch.device("cuda")
    results = []
    print(f"{'case':<11} {'variant':<12} {'ms (q1-q3)':>24} {'vs separate':>11}  configs (dkdv, dq)")
    for name in args.cases.split(","):
        case = CASES[name]
        x = make_inputs(case, device, SEED)
        report = check(case, x)
        fns = {v: backward(case, x, v) for v in VARIANTS}
        chosen = {}
        for variant, fn in fns.items():  # tunes each variant on this case; the configs it chose
            fn()
            dkdv = DKDV if variant == "separate" else DKDV_ATOMIC
            chosen[variant] = [None if k.last is None else str(k.last[1]) for k in (dkdv, DQ)]
            if variant != "separate":
                chosen[variant][1] = "-"
        times = rotated_rounds(fns, args.rounds)
        row: dict[str, Any] = {"case": name, "rows": x["rows"], "squares": x["squares"], "checks": report,
                               "chosen": chosen, "variants": {}, "trials": DKDV_ATOMIC.records()}
        stats = {variant: spread(times[variant]) for variant in VARIANTS}
        for variant, st in stats.items():
            speed = stats["separate"]["median"] / st["median"]
            row["variants"][variant] = {**st, "speedup": speed}
            print(f"{name:<11} {variant:<12} {cell(st):>24} {speed:>10.3f}x  {chosen[variant]}", flush=True)
        results.append(row)
        del x
        torch.cuda.empty_cache()
    save_results(args.out, results, rounds=args.rounds, extra_configs=args.extra_configs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
