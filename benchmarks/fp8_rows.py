"""Row-scaled fp8 quantization of a gradient-shaped tensor: the one-pass kernel against the stats and
cast passes, interleaved on the same inputs.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/fp8_rows.py --out fp8_rows.json
    TRITON_INTERPRET=1 python benchmarks/fp8_rows.py --smoke      # a CPU check of the script

What ``fp8_rowwise`` (weight gradient in bf16) asks of ``grad_output`` in backward: the e4m3 rows and
their scales for ``dx``, and the column sums for the bias gradient (``rows=True, cols_t=False,
col_sum=True``). Each shape is checked against ``quantize_fp8_reference`` first (the bytes and scales
equal, the column sums within 1e-5), on fresh random bf16 data; then the variants are timed in
rotated order, round after round, with CUDA events, and reported as medians with their spread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path

import torch

from gem_precision import fp8_rows_triton
from gem_precision.formats import E4M3
from gem_precision.fp8_quant_triton import quantize_fp8_triton
from gem_precision.fp8_reference import quantize_fp8_reference

SHAPES = [(200_000, 4096), (200_000, 1024)]  # the big config's uvqk and out gradients (rows ~ tokens)
VARIANTS = {  # name -> (ONE_PASS_MAX_N, ONE_PASS_TILE)
    "two_pass": (0, fp8_rows_triton.ONE_PASS_TILE),
    "one_pass_4096x4": (4096, (4096, 4)),
    "one_pass_8192x8": (4096, (8192, 8)),
    "one_pass_8192x16": (4096, (8192, 16)),
}


def use(name: str) -> None:
    fp8_rows_triton.ONE_PASS_MAX_N, fp8_rows_triton.ONE_PASS_TILE = VARIANTS[name]


def quantize(x: torch.Tensor):
    return quantize_fp8_triton(x, granularity="row", fmt=E4M3, rows=True, cols_t=False, col_sum=True)


def check(x: torch.Tensor) -> dict[str, float]:
    want = quantize_fp8_reference(x[:4096], granularity="row", fmt=E4M3, rows=True, cols_t=False, col_sum=True)
    out = {}
    for name in VARIANTS:
        use(name)
        got = quantize(x[:4096])
        same = torch.equal(got.rows.data.view(torch.uint8), want.rows.data.view(torch.uint8)) and torch.equal(
            got.rows.scale_inv, want.rows.scale_inv
        )
        err = ((got.col_sum - want.col_sum).abs().max() / want.col_sum.abs().max().clamp_min(1e-30)).item()
        if not same or err > 1e-5:
            raise SystemExit(f"{name}: the rows differ from the reference (bytes equal: {same}, col_sum error {err:.1e})")
        out[name] = err
    return out


def time_rounds(x: torch.Tensor, rounds: int, reps: int) -> dict[str, list[float]]:
    names = list(VARIANTS)
    times: dict[str, list[float]] = {n: [] for n in names}
    for name in names:  # warm-up: compiles every variant
        use(name)
        quantize(x)
    torch.cuda.synchronize()
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            use(name)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                quantize(x)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one round (CPU under TRITON_INTERPRET=1)")
    p.add_argument("--out")
    args = p.parse_args()
    device = "cpu" if args.smoke else "cuda"
    shapes = [(300, 96), (70, 40)] if args.smoke else SHAPES
    torch.manual_seed(args.seed)
    rows = []
    saved = (fp8_rows_triton.ONE_PASS_MAX_N, fp8_rows_triton.ONE_PASS_TILE)
    try:
        for m, n in shapes:
            x = torch.randn(m, n, device=device).mul_(torch.rand(m, 1, device=device) * 8).bfloat16()
            errors = check(x)
            if args.smoke:
                rows.append({"shape": [m, n], "col_sum_error": errors})
                continue
            times = time_rounds(x, args.rounds, args.reps)
            base = statistics.median(times["two_pass"])
            for name, ts in times.items():
                q = statistics.quantiles(ts, n=4)
                moved = m * n * 2 + m * n  # one read of bf16, one write of e4m3 (the least any variant moves)
                rows.append({"shape": [m, n], "variant": name, "median_ms": statistics.median(ts), "q1_ms": q[0],
                             "q3_ms": q[2], "speedup_over_two_pass": base / statistics.median(ts),
                             "tb_per_s_min_traffic": moved / statistics.median(ts) / 1e9,
                             "col_sum_error": errors[name]})  # fmt: skip
    finally:
        fp8_rows_triton.ONE_PASS_MAX_N, fp8_rows_triton.ONE_PASS_TILE = saved
    if args.smoke:
        print(f"smoke: every variant equals the reference on {[r['shape'] for r in rows]}")
    else:
        print(f"{'shape':>14} {'variant':<18} {'median ms':>10} {'q1-q3 ms':>15} {'vs two-pass':>11} {'TB/s*':>6}")
        for r in rows:
            print(f"{tuple(r['shape'])!s:>14} {r['variant']:<18} {r['median_ms']:>10.3f} "
                  f"{r['q1_ms']:>7.3f}-{r['q3_ms']:<7.3f} {r['speedup_over_two_pass']:>10.2f}x "
                  f"{r['tb_per_s_min_traffic']:>6.2f}")  # fmt: skip
        print("* one bf16 read and one e4m3 write of the tensor per call, over the median time")
    if args.out:
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__}  # fmt: skip
        Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
