"""The bf16 linear's weight and bias gradients into float32 masters: computed in bf16 and cast (autograd's
form, two kernels each) against written in float32 by the GEMM and the reduction
(``gem_precision.bf16_linear``), interleaved on the same data.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/weight_grad.py --out weight_grad.json
    python benchmarks/weight_grad.py --smoke       # a CPU check of the script (the float32 GEMM is CUDA's)

Shapes of ``configs/h200-large.yaml``'s linears over ~200,000 tokens: the HSTU block's ``uvqk`` (1024 ->
4096) and ``out`` (1024 -> 1024). Both forms are checked against float64 on fresh random data (the
direct form must be at least as close, within float32 rounding), then timed with CUDA events in
rotated order: ``dW`` and ``db`` together, medians with quartiles.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import rotated_rounds, save_results  # beside this script

CASES = {"uvqk": (200_000, 1024, 4096), "out": (200_000, 1024, 1024)}


def cast_form(g: torch.Tensor, x: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    return lambda: (torch.mm(g.t(), x).float(), g.sum(0).float())


def direct_form(g: torch.Tensor, x: torch.Tensor) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    return lambda: (torch.mm(g.t(), x, out_dtype=torch.float32), g.sum(0, dtype=torch.float32))


def rel(a: torch.Tensor, exact: torch.Tensor) -> float:
    return float((a.double() - exact).norm() / exact.norm())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, the cast form only")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    gen = torch.Generator(device=device).manual_seed(torch.seed() % 2**31)
    results = []
    print(f"{'case':>5} {'tokens':>8} {'in':>5} {'out':>5} | {'cast ms':>16} | {'direct ms':>16} | "
          f"{'cast/direct':>11} | {'err dW cast':>11} {'direct':>9} | {'err db cast':>11} {'direct':>9}")  # fmt: skip
    for case, (tokens, d_in, d_out) in CASES.items():
        if args.smoke:
            tokens, d_in, d_out = 64, 32, 48
        x = torch.randn(tokens, d_in, device=device, generator=gen).bfloat16()
        g = torch.randn(tokens, d_out, device=device, generator=gen).bfloat16()
        exact_w, exact_b = g.double().t() @ x.double(), g.double().sum(0)
        forms = {"cast": cast_form(g, x)} if args.smoke else {"cast": cast_form(g, x), "direct": direct_form(g, x)}
        errors = {
            name: [rel(t, e) for t, e in zip(fn(), (exact_w, exact_b), strict=True)] for name, fn in forms.items()
        }
        if "direct" in errors and any(d > c + 1e-6 for d, c in zip(errors["direct"], errors["cast"], strict=True)):
            raise SystemExit(f"{case}: the direct form is further from float64 than the cast form: {errors}")
        if args.smoke:
            print(f"{case:>5} smoke: errors {errors}")
            continue
        times = rotated_rounds(forms, args.rounds)
        q = {n: statistics.quantiles(t, n=4, method="inclusive") for n, t in times.items()}
        ratio = statistics.median(c / d for c, d in zip(times["cast"], times["direct"], strict=True))
        print(f"{case:>5} {tokens:>8} {d_in:>5} {d_out:>5} | "
              + " | ".join(f"{q[n][1]:6.3f} ({q[n][0]:.3f}-{q[n][2]:.3f})" for n in forms)
              + f" | {ratio:10.3f}x | {errors['cast'][0]:11.2e} {errors['direct'][0]:9.2e} | "
              f"{errors['cast'][1]:11.2e} {errors['direct'][1]:9.2e}", flush=True)  # fmt: skip
        results.append({"case": case, "tokens": tokens, "in": d_in, "out": d_out, "ms": times,
                        "median_ms": {n: q[n][1] for n in forms}, "cast_over_direct": ratio, "errors": errors})  # fmt: skip
    save_results(args.out, results, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
