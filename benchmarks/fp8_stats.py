"""The fp8 amax pass alone: how close `_fp8_stats_kernel` runs to the memory bandwidth, per tiling.

The pass reads a bf16 operand once and gives its row amaxes, column amaxes and column sums (what
the fp8 rowwise linear's backward asks for). Each tiling is checked against torch on fresh random
data before it is timed. Besides the package's kernel at several tile sizes, one variant keeps no
loop at all: each program reduces one tile and stores row, column and sum partials, which torch
reduces afterwards (no atomics, no per-iteration layout conversion).

    python benchmarks/fp8_stats.py --out fp8_stats.json            # on the GPU
    TRITON_INTERPRET=1 python benchmarks/fp8_stats.py --smoke       # tiny, on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl

from gem_precision.fp8_quant_triton import _fp8_stats_kernel
from gem_precision.triton_common import abs_bits


@triton.jit
def _stats_tile_kernel(
    x_ptr, M, N, stride_xm, row_part_ptr, col_part_ptr, sum_part_ptr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    bits = abs_bits(x)
    tl.store(row_part_ptr + pid_n.to(tl.int64) * M + rows, tl.max(bits, axis=1), mask=rows < M)
    tl.store(col_part_ptr + pid_m.to(tl.int64) * N + cols, tl.max(bits, axis=0), mask=cols < N)
    tl.store(sum_part_ptr + pid_m.to(tl.int64) * N + cols, tl.sum(x, axis=0), mask=cols < N)


def looped(x: torch.Tensor, rows_per_prog: int, block_m: int, block_n: int, warps: int):
    m, n = x.shape
    row_part = torch.empty((triton.cdiv(n, block_n), m), dtype=torch.int32, device=x.device)
    col = torch.zeros(n, dtype=torch.int32, device=x.device)
    tensor = torch.zeros(1, dtype=torch.int32, device=x.device)
    progs = triton.cdiv(m, rows_per_prog)
    sums = torch.empty((progs, n), dtype=torch.float32, device=x.device)
    _fp8_stats_kernel[(progs, triton.cdiv(n, block_n))](
        x, m, n, x.stride(0), row_part, col, tensor, sums, ROW=True, COL=True, TENSOR=False, COL_SUM=True,
        ROWS_PER_PROG=rows_per_prog, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
    )  # fmt: skip
    return row_part.amax(0), col, sums.sum(0)


def tiled(x: torch.Tensor, block_m: int, block_n: int, warps: int):
    m, n = x.shape
    gm, gn = triton.cdiv(m, block_m), triton.cdiv(n, block_n)
    row_part = torch.empty((gn, m), dtype=torch.int32, device=x.device)
    col_part = torch.empty((gm, n), dtype=torch.int32, device=x.device)
    sum_part = torch.empty((gm, n), dtype=torch.float32, device=x.device)
    _stats_tile_kernel[(gm, gn)](x, m, n, x.stride(0), row_part, col_part, sum_part,
                                 BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps)  # fmt: skip
    return row_part.amax(0), col_part.amax(0), sum_part.sum(0)


def check(x: torch.Tensor, got) -> None:
    ax = x.float().abs()
    row, col, s = got
    want_row = ax.amax(1).view(torch.int32)
    want_col = ax.amax(0).view(torch.int32)
    assert torch.equal(row, want_row), "row amax"
    assert torch.equal(col, want_col), "column amax"
    torch.testing.assert_close(s, x.float().sum(0), rtol=1e-4, atol=1e-3 * float(x.float().sum(0).abs().max()))


def time_ms(fn) -> float:
    if not torch.cuda.is_available():
        return float("nan")
    return float(triton.testing.do_bench(fn, warmup=10, rep=50))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=229_376, help="M: tokens of one step of h200-large")
    p.add_argument("--cols", type=int, default=4096)
    p.add_argument("--smoke", action="store_true", help="a tiny shape and tiles (CPU, TRITON_INTERPRET=1)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m, n = (100, 70) if args.smoke else (args.rows, args.cols)
    x = torch.randn(m, n, device=device, dtype=torch.bfloat16, generator=None) * 3
    x[m // 2, n // 3] = -1000.0  # one large value: each amax must find its own
    variants: list[tuple[str, object]] = []
    if args.smoke:
        variants += [("looped 32x16x32 w4", lambda: looped(x, 32, 16, 32, 4)), ("tiled 16x32 w4", lambda: tiled(x, 16, 32, 4))]
    else:
        # the package's tiles (128 rows of 64 x 64, 4 warps) first, then the earlier and other choices
        for rpp, bm, bn, w in ((128, 64, 64, 4), (512, 32, 128, 8), (256, 32, 128, 4), (1024, 32, 128, 8),
                               (512, 64, 128, 8), (512, 16, 256, 8), (256, 16, 256, 4), (128, 32, 128, 4)):
            variants.append((f"looped rows/prog {rpp}, {bm}x{bn}, {w} warps", lambda a=(rpp, bm, bn, w): looped(x, *a)))
        for bm, bn, w in ((128, 64, 4), (256, 64, 8), (256, 64, 4), (128, 32, 4), (64, 64, 4), (64, 128, 4),
                          (128, 128, 8), (64, 256, 8), (32, 256, 4), (256, 32, 8), (512, 64, 8), (128, 64, 8)):
            variants.append((f"tiled {bm}x{bn}, {w} warps", lambda a=(bm, bn, w): tiled(x, *a)))
    gbytes = x.numel() * x.element_size() / 1e9
    results = []
    print(f"x: {m} x {n} bf16 ({gbytes:.2f} GB read per pass) on {device}")
    print(f"{'variant':<44} {'ms':>8} {'TB/s':>7}")
    for name, fn in variants:
        check(x, fn())
        ms = time_ms(fn)
        tbs = gbytes / ms if ms == ms else float("nan")
        results.append({"variant": name, "ms": ms, "tb_per_s": tbs})
        print(f"{name:<44} {ms:8.3f} {tbs:7.2f}")
    if args.out:
        meta = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "shape": [m, n],
                "torch": torch.__version__, "triton": triton.__version__}  # fmt: skip
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
