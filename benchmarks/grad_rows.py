"""The output gradients' e4m3 rows written by the kernels that write the gradients, against the linear's
own one-pass row quantization after them, interleaved on the same inputs: the fused HSTU gap's last
backward pass (the ``uvqk`` gradient, against the in-place ``silu'`` passes and the rows), the same pass
summing the bias gradient of a bf16 step without rows (``bias_grad_in_gap``, against the ``silu'`` pass
and the linear's own reduction), and the layer norm's backward (the previous block's ``out`` gradient,
through the residual add).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/grad_rows.py --out grad_rows.json
    TRITON_INTERPRET=1 python benchmarks/grad_rows.py --smoke      # a CPU check of the script

Shapes of ``configs/h200-large.yaml`` (8 heads of 128: ``d_pre`` is ``[L, 4096]``, ``u`` its first 1024
columns; the layer norm's gradient ``[L, 1024]``, with the residual's), with ``dq`` in place (``dq: separate``, what ``auto`` picks there) and from the atomic mode's
float32 accumulator. Every variant's gradient, bytes and scales are checked equal to the separate
passes' (the column sums within 1e-5) on fresh random data; then each call is timed alone with CUDA
events (the gradient reset from a pristine copy before it, outside the events), the variants in
rotated order round after round, and reported as medians with their spread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from gem_kernels import hstu_gap_grad_rows
from gem_kernels.hstu_gap_grad_rows import silu_grad_rows
from gem_kernels.hstu_gap_triton import silu_columns
from gem_kernels.layer_norm_triton import norm_fork
from gem_kernels.quantized_rows_triton import RowsOut
from gem_model.api import GradRowsSlot, RowQuantization
from gem_precision.formats import E4M3
from gem_precision.fp8_rows_triton import quantize_rows

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import rotated_rounds, save_results  # beside this script

HV, HQ = 1024, 1024  # 8 heads of 128: u, v, q, k columns 1024 wide each
WIDTH = 2 * HV + 2 * HQ
Q_COLS = slice(2 * HV, 2 * HV + HQ)
WARPS = [4, 8, 16]


def separate(pre: torch.Tensor, d_pre: torch.Tensor, dq: torch.Tensor | None) -> tuple:
    """Today's passes: ``silu'`` in place (q from the accumulator), then the linear's one-pass rows."""
    if dq is None:
        silu_columns(pre[:, HV:], d_pre[:, HV:], grad=d_pre[:, HV:])
    else:
        silu_columns(pre[:, Q_COLS], d_pre[:, Q_COLS], grad=dq)
        for c in (slice(HV, 2 * HV), slice(2 * HV + HQ, WIDTH)):
            silu_columns(pre[:, c], d_pre[:, c], grad=d_pre[:, c])
    pair = quantize_rows(d_pre, E4M3, col_sum=True)
    return pair.rows.data.view(torch.uint8), pair.rows.scale_inv.reshape(-1), pair.col_sum


def whole_rows(warps: int) -> Callable[..., tuple]:
    def run(pre: torch.Tensor, d_pre: torch.Tensor, dq: torch.Tensor | None) -> tuple:
        hstu_gap_grad_rows.WARPS_WIDE = {False: warps, True: warps}
        out = RowsOut.allocate(pre.shape[0], WIDTH, pre.device, RowQuantization())
        sums = silu_grad_rows(pre, d_pre, HV, out, dq=None if dq is None else (dq, Q_COLS), col_sum=True)
        return out.data, out.scale_inv, sums

    return run


def variants() -> dict[str, Callable[..., tuple]]:
    return {"separate": separate, **{f"whole_rows_w{w}": whole_rows(w) for w in WARPS}}


def inputs(rows: int, device: str, with_dq: bool, gen: torch.Generator) -> tuple:
    pre = (torch.randn(rows, WIDTH, generator=gen) * 2).bfloat16().to(device)
    d_pre = (torch.randn(rows, WIDTH, generator=gen) * torch.rand(rows, 1, generator=gen) * 4).bfloat16().to(device)
    dq = torch.randn(rows, HQ, generator=gen).to(device) if with_dq else None
    return pre, d_pre, dq


def check(pre: torch.Tensor, pristine: torch.Tensor, dq: torch.Tensor | None) -> dict[str, float]:
    want_grad = pristine.clone()
    want = separate(pre, want_grad, dq)
    errors = {}
    for name, fn in variants().items():
        got_grad = pristine.clone()
        got = fn(pre, got_grad, dq)
        same = torch.equal(got_grad, want_grad) and torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        err = ((got[2] - want[2]).abs().max() / want[2].abs().max().clamp_min(1e-30)).item()
        if not same or err > 1e-5:
            raise SystemExit(
                f"{name}: differs from the separate passes (gradient and rows equal: {same}, sums {err:.1e})"
            )
        errors[name] = err
    return errors


def time_rounds(
    pre: torch.Tensor, pristine: torch.Tensor, dq: torch.Tensor | None, rounds: int,
    fns: dict[str, Callable[..., tuple]] | None = None,
) -> dict[str, list[float]]:
    fns = fns or variants()
    names = list(fns)
    d_pre = pristine.clone()
    for name in names:  # warm-up: compiles every variant
        fns[name](pre, d_pre, dq)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(r + j) % len(names)]
            d_pre.copy_(pristine)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name](pre, d_pre, dq)
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end))
    return times


def bias_separate(pre: torch.Tensor, d_pre: torch.Tensor, dq: torch.Tensor | None) -> tuple:
    """The bf16 step today: the in-place ``silu'`` pass, then the ``uvqk`` linear's bias gradient, its own
    reduction over the whole gradient (``grad.sum(0)`` in the gradient's dtype, as the linear's backward)."""
    silu_columns(pre[:, HV:], d_pre[:, HV:], grad=d_pre[:, HV:])
    return (d_pre.sum(0),)


def bias_whole_rows(pre: torch.Tensor, d_pre: torch.Tensor, dq: torch.Tensor | None) -> tuple:
    """``bias_grad_in_gap`` in a bf16 step: one pass over whole rows, no e4m3 rows, the column sums."""
    return (silu_grad_rows(pre, d_pre, HV, None, col_sum=True).to(d_pre.dtype),)


def bias_tiled(warps: int, rows_at_once: int) -> Callable[..., tuple]:
    """``bias_whole_rows`` on ``warps`` warps loading ``rows_at_once`` rows an iteration (the shipped
    tile: ``WARPS_SUMS_ONLY`` warps, one row)."""

    def run(pre: torch.Tensor, d_pre: torch.Tensor, dq: torch.Tensor | None) -> tuple:
        hstu_gap_grad_rows.WARPS_SUMS_ONLY, hstu_gap_grad_rows.ROWS_AT_ONCE = warps, rows_at_once
        try:
            return bias_whole_rows(pre, d_pre, dq)
        finally:
            hstu_gap_grad_rows.WARPS_SUMS_ONLY, hstu_gap_grad_rows.ROWS_AT_ONCE = SHIPPED

    return run


SHIPPED = (hstu_gap_grad_rows.WARPS_SUMS_ONLY, hstu_gap_grad_rows.ROWS_AT_ONCE)
BIAS_VARIANTS = {"separate": bias_separate, "bias_whole_rows": bias_whole_rows,
                 **{f"bias_w{w}_r{r}": bias_tiled(w, r) for w in WARPS for r in (1, 2) if (w, r) != SHIPPED}}  # fmt: skip


def check_bias(pre: torch.Tensor, pristine: torch.Tensor) -> float:
    """Both bias variants write the same gradient; the sums' largest error against float64, relative."""
    want_grad = pristine.clone()
    bias_separate(pre, want_grad, None)
    exact = want_grad.double().sum(0)
    worst = 0.0
    for name, fn in BIAS_VARIANTS.items():
        got_grad = pristine.clone()
        (sums,) = fn(pre, got_grad, None)
        err = ((sums.double() - exact).abs().max() / exact.abs().max().clamp_min(1e-30)).item()
        if not torch.equal(got_grad, want_grad) or err > 1e-2:  # bf16 sums: a rounding step is 2**-8
            raise SystemExit(f"bias {name}: gradient equal {torch.equal(got_grad, want_grad)}, sums' error {err:.1e}")
        worst = max(worst, err)
    return worst


def layer_norm_variants(rows: int, device: str, gen: torch.Generator) -> tuple[dict[str, Callable[[], tuple]], float]:
    """The layer norm's backward (through autograd on one retained forward) without and with the rows:
    ``separate``: ``dx``, then the linear's one-pass rows and column sums; ``in_layer_norm``: the rows
    written by the layer norm's pass, the column sums by the linear's torch reduction (as the linear
    does when offered rows alone). Checked equal first; returns the variants and the sums' error."""
    x = (torch.randn(rows, HV, generator=gen) * 3 + 1).bfloat16().to(device).requires_grad_()
    d_ln = torch.randn(rows, HV, generator=gen).bfloat16().to(device)
    d_skip = torch.randn(rows, HV, generator=gen).bfloat16().to(device)
    ln, skip, _ = norm_fork(x)
    node = ln.grad_fn

    def backward() -> torch.Tensor:
        return torch.autograd.grad((ln, skip), x, (d_ln, d_skip), retain_graph=True)[0]

    def separate_ln() -> tuple:
        node.grad_rows = None
        dx = backward()
        pair = quantize_rows(dx, E4M3, col_sum=True)
        return dx, pair.rows.data.view(torch.uint8), pair.rows.scale_inv.reshape(-1), pair.col_sum

    def in_norm() -> tuple:
        node.grad_rows = slot = GradRowsSlot(column_sum=True)
        dx = backward()
        offered = slot.take(dx)
        assert offered is not None
        return dx, offered.rows.data.view(torch.uint8), offered.rows.scale_inv, dx.sum(0, dtype=torch.float32)

    want, got = separate_ln(), in_norm()
    # the kernel compiled with and without the rows may round a few dx values one bf16 step apart on the
    # GPU (288 of 200M on the H200, 2026-12-03): the rows must be the reference's of the dx it stored
    own = quantize_rows(got[0], E4M3, col_sum=False)
    same = torch.equal(got[1], own.rows.data.view(torch.uint8)) and torch.equal(got[2], own.rows.scale_inv.reshape(-1))
    # one bf16 step, and near zero (where dx is a difference of larger fp32 terms whose order of
    # summation differs between the two compilations) 2**-12 of the largest |dx|: a run on the H200
    # (2026-12-03) failed the check with no absolute floor
    g, w = got[0].float(), want[0].float()
    far = (g - w).abs() > 2**-7 * w.abs() + 2**-12 * w.abs().max()
    err = ((got[3] - want[3]).abs().max() / want[3].abs().max().clamp_min(1e-30)).item()
    if not same or bool(far.any()) or err > 1e-4:
        raise SystemExit(
            f"layer norm rows: rows are its dx's {same}; dx values beyond a bf16 step of the separate pass's: "
            f"{int(far.sum())} of {far.numel()} (largest difference {(g - w).abs().max().item():.2e}); sums {err:.1e}"
        )
    return {"separate": separate_ln, "in_layer_norm": in_norm}, err


def rows_of(times: dict[str, list[float]], rows: int, case: str, errors: dict[str, float]) -> list[dict]:
    """One result row per variant: median and quartiles, and the speed-up over ``separate``."""
    base = statistics.median(times["separate"])
    out = []
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        out.append({"rows": rows, "dq": case, "variant": name, "median_ms": statistics.median(ts), "q1_ms": q[0],
                    "q3_ms": q[2], "speedup_over_separate": base / statistics.median(ts), "col_sum_error": errors[name]})  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="a few rows, one check (CPU under TRITON_INTERPRET=1)")
    p.add_argument("--out")
    args = p.parse_args()
    device = "cpu" if args.smoke else "cuda"
    gen = torch.Generator().manual_seed(args.seed)
    saved = dict(hstu_gap_grad_rows.WARPS_WIDE)
    results = []
    try:
        for with_dq in (False, True):
            pre, pristine, dq = inputs(5 if args.smoke else args.rows, device, with_dq, gen)
            errors = check(pre, pristine, dq)
            if not args.smoke:
                times = time_rounds(pre, pristine, dq, args.rounds)
                results += rows_of(times, args.rows, "accumulator" if with_dq else "in_place", errors)
        pre, pristine, _ = inputs(5 if args.smoke else args.rows, device, False, gen)
        bias_err = check_bias(pre, pristine)
        if not args.smoke:
            times = time_rounds(pre, pristine, None, args.rounds, BIAS_VARIANTS)
            results += rows_of(times, args.rows, "bf16_bias", dict.fromkeys(times, bias_err))
        ln_fns, ln_err = layer_norm_variants(13 if args.smoke else args.rows, device, gen)
        if not args.smoke:
            times = rotated_rounds(ln_fns, args.rounds)
            results += rows_of(times, args.rows, "layer_norm", dict.fromkeys(times, ln_err))
    finally:
        hstu_gap_grad_rows.WARPS_WIDE = saved
    if args.smoke:
        print("smoke: every variant equals the separate passes (the gap's, the bf16 bias sums' and the layer norm's)")
        return 0
    print(f"{'dq':<12} {'variant':<16} {'median ms':>10} {'q1-q3 ms':>15} {'vs separate':>11}")
    for r in results:
        print(f"{r['dq']:<12} {r['variant']:<16} {r['median_ms']:>10.3f} {r['q1_ms']:>7.3f}-{r['q3_ms']:<7.3f} "
              f"{r['speedup_over_separate']:>10.3f}x")  # fmt: skip
    save_results(args.out, results, rounds=args.rounds, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
