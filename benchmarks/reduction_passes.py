"""Two small reductions of the big config's step, torch against our Triton kernels, as device time:

- ``bias``: a linear's bias gradient, the float32 column sums of its output gradient ``[207000, 1024]``
  bf16 (the eight ``out`` linears'): ``g.sum(0, dtype=float32)`` against
  ``gem_precision.column_sums_triton.column_sums`` (``bf16_linear.BIAS_GRAD_KERNEL``);
- ``unit_rows``: the next-item loss's shared negatives ``[384 * 128, 1024]`` bf16 normalised to unit rows
  and the gradient back through it: ``gem_model.api.unit_rows`` / ``unit_rows_vjp`` in float32 against
  ``gem_kernels.unit_rows_triton`` (``next_item_loss_triton.UNIT_ROWS_KERNEL``).

- ``norm_sums`` and ``norm_rows_sums``: the HSTU block's layer norm backward (``[207000, 1024]`` bf16,
  with the residual's gradient), which writes the gradient of the previous block's ``out`` linear, and
  that linear's bias gradient: the pass and then ``column_sums`` of its output (the ``bf16`` scheme's
  linear), against the pass summing the columns as it stores them (``layer_norm_triton.norm_backward``'s
  ``col_sum``, at ``--sum-tiles`` tiles a program). ``norm_rows_sums``: the same with the gradient's e4m3
  rows written too (``fp8_rowwise``), whose linear summed with ``g.sum(0, dtype=float32)``.

Each is checked first on fresh random data against float64; then interleaved rounds (the variants'
order rotated), median and IQR, ``--iters`` calls a round queued behind a ``torch.cuda._sleep``. The
first variant of each case is its baseline.

    python benchmarks/reduction_passes.py --rounds 15 --out reduction_passes.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rounds import cell, rotated_queued_rounds, save_results, spread  # benchmarks/rounds.py, beside this script

from gem_kernels.layer_norm_triton import norm_backward
from gem_kernels.unit_rows_triton import unit_rows_triton, unit_rows_vjp_triton
from gem_model.api import L2_EPS, unit_rows, unit_rows_vjp
from gem_precision.column_sums_triton import column_sums


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def bias_case(args: argparse.Namespace) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    g = torch.randn(args.rows, args.dim, device=args.device).bfloat16()
    want = g.double().sum(0)
    errors = {"torch": relative(g.sum(0, dtype=torch.float32), want), "triton": relative(column_sums(g), want)}
    return {"torch": lambda: g.sum(0, dtype=torch.float32), "triton": lambda: column_sums(g)}, errors


def unit_rows_case(args: argparse.Namespace) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    n = torch.randn(args.negatives, args.dim, device=args.device).bfloat16()
    g = torch.randn(args.negatives, args.dim, device=args.device)
    n64 = n.double().requires_grad_()
    want_u = F.normalize(n64, dim=-1, eps=L2_EPS)
    (want_dx,) = torch.autograd.grad(want_u, n64, g.double())

    def torch_form() -> tuple[torch.Tensor, torch.Tensor]:
        u = unit_rows(n.float())[0].to(torch.bfloat16)
        unit, norm = unit_rows(n.float())  # the backward's own recomputation, as the loss did it
        return u, unit_rows_vjp(g, unit, norm).to(n.dtype)

    def triton_form() -> tuple[torch.Tensor, torch.Tensor]:
        u, norm = unit_rows_triton(n, torch.bfloat16)
        return u, unit_rows_vjp_triton(g, n, norm)

    errors = {}
    for name, fn in (("torch", torch_form), ("triton", triton_form)):
        u, dx = fn()
        errors[name] = max(relative(u, want_u.detach()), relative(dx, want_dx))
    return {"torch": torch_form, "triton": triton_form}, errors


def _norm_case(args: argparse.Namespace, rows_out: bool) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    def r(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.randn(args.rows, args.dim, device=args.device).to(dtype)

    x, dy, skip = r(), r(), r()
    mean = x.float().mean(1)
    rstd = torch.rsqrt(x.float().var(1, unbiased=False) + 1e-5)

    def separate() -> tuple[torch.Tensor, torch.Tensor]:
        dx, _, _ = norm_backward(x, dy, skip, mean, rstd, rows_out=rows_out)
        return dx, dx.sum(0, dtype=torch.float32) if rows_out else column_sums(dx)

    def in_pass(tiles: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def run() -> tuple[torch.Tensor, torch.Tensor]:
            dx, _, sums = norm_backward(x, dy, skip, mean, rstd, rows_out=rows_out, col_sum=True, sum_tiles=tiles)
            assert sums is not None
            return dx, sums

        return run

    fns: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {"separate": separate}
    fns.update({f"in_pass_{t}": in_pass(t) for t in args.sum_tiles})
    want_dx, _ = separate()
    want = want_dx.double().sum(0)  # the sums of the gradient as stored
    errors = {}
    for name, fn in fns.items():
        dx, sums = fn()
        if not torch.equal(dx, want_dx):
            raise SystemExit(f"norm sums: {name}'s gradient differs from the pass without sums")
        errors[name] = relative(sums, want)
    return fns, errors


def norm_sums_case(args: argparse.Namespace) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    return _norm_case(args, rows_out=False)


def norm_rows_sums_case(args: argparse.Namespace) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    return _norm_case(args, rows_out=True)


CASES = {"bias": bias_case, "unit_rows": unit_rows_case, "norm_sums": norm_sums_case, "norm_rows_sums": norm_rows_sums_case}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=207_000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--negatives", type=int, default=384 * 128)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sleep-cycles", type=int, default=50_000_000)
    parser.add_argument("--max-error", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cases", default=",".join(CASES), help=f"of {', '.join(CASES)}")
    parser.add_argument("--sum-tiles", type=lambda v: [int(t) for t in v.split(",")], default=[8, 16, 32],
                        help="tiles a program for the norm cases' in-pass sums, comma-separated")
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # the CPU test's cases
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("reduction_passes.py times CUDA kernels: no GPU here", file=sys.stderr)
        return 1
    torch.manual_seed(args.seed)
    results = []
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"--cases: unknown {unknown}; known: {', '.join(CASES)}")
    print("| case | variant | device ms a call, median (IQR) | against the first | error vs float64 |")
    print("|---|---|---|---|---|")
    for case in cases:
        fns, errors = CASES[case](args)
        if not all(e <= args.max_error for e in errors.values()):
            raise SystemExit(f"{case}: errors {errors} (max {args.max_error})")
        times = rotated_queued_rounds(fns, args.rounds, args.iters, args.sleep_cycles)
        base = spread(times[next(iter(fns))])["median"]
        for name in fns:
            s = spread(times[name])
            print(f"| {case} | {name} | {cell(s)} | {base / s['median']:.2f}x | {errors[name]:.1e} |")
            results.append({"case": case, "variant": name, **s, "error": errors[name]})
    save_results(args.out, results, rows=args.rows, dim=args.dim, negatives=args.negatives, rounds=args.rounds,
                 iters=args.iters, seed=args.seed, sum_tiles=args.sum_tiles)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
