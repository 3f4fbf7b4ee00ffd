"""The history's mean pooling (``gem_model.jagged.segment_mean``), forward and backward: ``index_add`` of
float32 copies (every row of a sequence adds atomically into the same ``D`` sums) against one GEMM
with the ``[B, N]`` 0/1 membership matrix (float32 accumulation, no copy), interleaved on the same data.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/segment_mean.py --out segment_mean.json
    python benchmarks/segment_mean.py --smoke       # a CPU check of the script

Lengths as ``configs/h200-large.yaml`` draws them (P(n) ~ (n + 1)^-s over 0..4095) for B = 384, s = 0.95,
and the second mix of ``benchmarks/results/e2e_ab.md`` (B = 256, s = 0.7); D = 1024, bf16. Both methods
are checked against float64 means (within a bf16 step) and their input gradients against each other
(equal) on fresh random data, then timed with CUDA events in rotated order, medians with quartiles.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from gem_model.jagged import segment_mean

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import rotated_rounds, save_results  # beside this script

D = 1024
CASES = {"big": (384, 0.95), "mix2": (256, 0.7)}
MAX_LEN = 4095


def lengths_of(batch: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    n = torch.arange(MAX_LEN + 1, dtype=torch.float64)
    return torch.multinomial((n + 1) ** -exponent, batch, replacement=True, generator=gen)


def method(gemm: bool, values: torch.Tensor, lengths: torch.Tensor, grad: torch.Tensor) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        values.grad = None
        segment_mean(values, lengths, gemm=gemm).backward(grad)
        return values.grad

    return run


def check(values: torch.Tensor, lengths: torch.Tensor, grad: torch.Tensor) -> float:
    """The largest error of either method's means against float64, relative to the largest |mean|;
    exits unless both are within a bf16 step and their gradients are equal."""
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    exact = torch.stack([values[a:b].double().mean(0) if b > a else values.new_zeros(D, dtype=torch.float64)
                         for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)])  # fmt: skip
    worst, grads = 0.0, []
    for gemm in (False, True):
        with torch.no_grad():
            mean = segment_mean(values, lengths, gemm=gemm).double()
        far = (mean - exact).abs() > 2**-8 * exact.abs() + 1e-6 * exact.abs().max()
        if bool(far.any()):
            raise SystemExit(f"gemm={gemm}: {int(far.sum())} means beyond a bf16 step of float64")
        worst = max(worst, ((mean - exact).abs().max() / exact.abs().max()).item())
        grads.append(method(gemm, values, lengths, grad)().clone())
    if not torch.equal(grads[0], grads[1]):
        raise SystemExit("the two methods' input gradients differ")
    return worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="small batches on the CPU, the check only")
    p.add_argument("--out")
    args = p.parse_args()
    device = "cpu" if args.smoke else "cuda"
    gen = torch.Generator().manual_seed(args.seed)
    results = []
    for case, (batch, exponent) in CASES.items():
        lengths = lengths_of(4 if args.smoke else batch, exponent, gen)
        if args.smoke:
            lengths = lengths % 50
        values = torch.randn(int(lengths.sum()), D, generator=gen).bfloat16().to(device).requires_grad_()
        grad = torch.randn(lengths.numel(), D, generator=gen).bfloat16().to(device)
        lengths = lengths.to(device)
        err = check(values, lengths, grad)
        if args.smoke:
            continue
        fns = {"index_add": method(False, values, lengths, grad), "gemm": method(True, values, lengths, grad)}
        times = rotated_rounds(fns, args.rounds)
        base = statistics.median(times["index_add"])
        for name, ts in times.items():
            q = statistics.quantiles(ts, n=4)
            results.append({"case": case, "batch": batch, "rows": values.shape[0], "method": name,
                            "median_ms": statistics.median(ts), "q1_ms": q[0], "q3_ms": q[2],
                            "speedup": base / statistics.median(ts), "max_rel_error": err})  # fmt: skip
    if args.smoke:
        print("smoke: both methods within a bf16 step of float64 means, gradients equal")
        return 0
    print(f"{'case':<6} {'rows':>8} {'method':<10} {'median ms':>10} {'q1-q3 ms':>15} {'speed-up':>9}")
    for r in results:
        print(f"{r['case']:<6} {r['rows']:>8} {r['method']:<10} {r['median_ms']:>10.3f} "
              f"{r['q1_ms']:>7.3f}-{r['q3_ms']:<7.3f} {r['speedup']:>8.2f}x")  # fmt: skip
    save_results(args.out, results, rounds=args.rounds, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
