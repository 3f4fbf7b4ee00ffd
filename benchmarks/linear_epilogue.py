"""The HSTU block's GEMMs with their pointwise work in the epilogue (``gem_kernels.linear_epilogue_triton``)
against what the block runs today, on the big config's shapes:

- ``uvqk``: cuBLAS (``torch.addmm``), then the silu pass over the ``v, q, k`` columns
  (``hstu_gap_triton.silu_columns``), against ``linear_silu``;
- ``out``: cuBLAS, then the residual add, against ``linear_residual``.

Also each GEMM alone (cuBLAS, and Triton without the epilogue's work where that exists), so that the
epilogue's cost shows apart from the GEMM's speed. Every Triton variant is checked before timing: its
output against cuBLAS's (error relative to the largest entry), and ``post`` bit-equal to ``silu_columns``
of its ``pre``. Interleaved rounds, CUDA events, median and IQR.

    python benchmarks/linear_epilogue.py --rows 207000 --rounds 20 --out linear_epilogue.json

Shapes of ``configs/h200-large.yaml``: ``x [L, 1024]``; uvqk's weight ``[4096, 1024]`` (silu from column
1,024), out's ``[1024, 1024]``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
from rounds import cell, rotated_queued_rounds, rotated_rounds, save_results, spread  # benchmarks/rounds.py

from gem_kernels.hstu_gap_triton import silu_columns
from gem_kernels.linear_epilogue_triton import CONFIGS, linear_residual, linear_silu

K, SILU_FROM = 1024, 1024
WIDTH = {"uvqk": 4096, "out": 1024}


def variants(case: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, extra: torch.Tensor,
             configs: list[str]) -> dict[str, Callable[[], object]]:  # fmt: skip
    """The variants of one case; ``extra`` is ``post``'s buffer (uvqk) or the residual (out)."""
    fns: dict[str, Callable[[], object]] = {}
    if case == "uvqk":
        fns["cublas+silu_columns"] = lambda: silu_columns(torch.addmm(b, x, w.T)[:, SILU_FROM:], extra)
    else:
        fns["cublas+add"] = lambda: extra + torch.addmm(b, x, w.T)
    fns["cublas"] = lambda: torch.addmm(b, x, w.T)
    for name in configs:
        if case == "uvqk":
            fns[f"triton {name}"] = lambda name=name: linear_silu(x, w, b, SILU_FROM, config=name, post=extra)
            fns[f"triton {name} (pre only)"] = lambda name=name: linear_silu(x, w, b, SILU_FROM, config=name,
                                                                            write_post=False, post=extra)  # fmt: skip
        else:
            fns[f"triton {name}"] = lambda name=name: linear_residual(x, w, b, extra, config=name)
    return fns


def check(case: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, extra: torch.Tensor, configs: list[str],
          max_error: float) -> dict[str, float]:  # fmt: skip
    """Each config's largest error relative to cuBLAS's largest entry. A config over ``max_error``, or
    whose ``post`` is not ``silu_columns`` of its ``pre`` bit for bit, is reported and left out of the
    timing (the configs that pass are still timed)."""
    ref = torch.addmm(b, x, w.T).float()
    if case == "out":
        ref = ref + extra.float()
    errors = {}
    for name in configs:
        try:
            outputs = linear_silu(x, w, b, SILU_FROM, config=name) if case == "uvqk" else (
                linear_residual(x, w, b, extra, config=name), None)
        except Exception as e:  # e.g. a config whose buffers do not fit this epilogue's shared memory
            print(f"{case} {name}: did not run ({type(e).__name__}: {str(e)[:200]}); not timed")
            continue
        if case == "uvqk":
            got, post = outputs
            expected = silu_columns(got[:, SILU_FROM:], torch.empty_like(post))
            if not torch.equal(post, expected):
                diff = (post.float() - expected.float()).abs().max().item()
                print(f"uvqk {name}: post is not silu_columns of pre (largest difference {diff:.2e}); not timed")
                continue
        else:
            got = outputs[0]
        error = ((got.float() - ref).abs().max() / ref.abs().max()).item()
        if not error <= max_error:
            print(f"{case} {name}: error {error:.2e} (max {max_error}); not timed")
            continue
        errors[name] = error
    return errors


def run_case(case: str, rows: int, configs: list[str], rounds: int, max_error: float, queued: int) -> list[dict]:
    dev = torch.device("cuda")
    n = WIDTH[case]
    x = torch.randn(rows, K, device=dev).bfloat16()
    w = (torch.randn(n, K, device=dev) / K**0.5).bfloat16()
    b = torch.randn(n, device=dev).bfloat16()
    extra = (torch.empty(rows, n - SILU_FROM, device=dev) if case == "uvqk" else torch.randn(rows, n, device=dev)).bfloat16()
    errors = check(case, x, w, b, extra, configs, max_error)
    fns = variants(case, x, w, b, extra, [c for c in configs if c in errors])
    # --queued: calls queued behind a sleep, so the host's launch time is not counted, as in a training step
    times = rotated_queued_rounds(fns, rounds, queued, 50_000_000) if queued else rotated_rounds(fns, rounds)
    flop = 2 * rows * K * n
    base_name = next(iter(times))
    base = spread(times[base_name])["median"]
    print(f"\n{case}: rows {rows}, K {K}, N {n}; {rounds} interleaved rounds")
    print(f"| variant | ms median (IQR) | GEMM TFLOP/s | vs {base_name} | error |")
    print("|---|---|---|---|---|")
    results = []
    for name, ms in times.items():
        s = spread(ms)
        config = name.split()[1] if name.startswith("triton") else None
        err = f"{errors[config]:.1e}" if config else ""
        print(f"| {name} | {cell(s)} | {flop / s['median'] / 1e9:.0f} | {base / s['median']:.3f}x | {err} |")
        results.append({"case": case, "variant": name, **s, "tflops": flop / s["median"] / 1e9,
                        "error": errors.get(config) if config else None})  # fmt: skip
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=207000)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--cases", default="uvqk,out")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--max-error", type=float, default=1e-2)
    parser.add_argument("--queued", type=int, default=0, help="time N calls queued behind a sleep (device time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("linear_epilogue.py times CUDA kernels: no GPU here", file=sys.stderr)
        return 1
    configs = [c for c in args.configs.split(",") if c]
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS] + [c for c in cases if c not in WIDTH]
    if unknown:
        raise SystemExit(f"unknown --configs or --cases {unknown}; configs: {sorted(CONFIGS)}, cases: {sorted(WIDTH)}")
    torch.manual_seed(args.seed)
    results = [r for case in cases for r in run_case(case, args.rows, configs, args.rounds, args.max_error, args.queued)]
    save_results(args.out, results, rows=args.rows, k=K, widths=WIDTH, silu_from=SILU_FROM, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
