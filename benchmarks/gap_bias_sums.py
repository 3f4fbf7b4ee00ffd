"""Where the fused HSTU gap's bf16 backward sums the ``u`` columns of the ``uvqk`` bias's gradient: in the
last pass, which then reads whole rows (``in_last_pass``, before 2026-12-07), or in the norm-gate backward
that writes those columns, the last pass reading only ``v, q, k`` (``in_norm_gate``,
``hstu_gap_triton.U_SUMS_IN_NORM_GATE``). Each variant runs the two kernels the way the gap does; both
write the same gradient (bit for bit) and the same column sums (checked against float64 within 1e-5 on
fresh random data first). Then each pair of calls is timed alone with CUDA events, the variants in rotated
order round after round, and reported as medians with their spread.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/gap_bias_sums.py --out gap_bias_sums.json
    TRITON_INTERPRET=1 python benchmarks/gap_bias_sums.py --smoke      # a CPU check of the script

Shapes of ``configs/h200-large.yaml``: ``d_pre [L, 4096]`` (8 heads of 128; ``u`` its first 1024 columns),
the attention output and the norm-gate's gradient ``[L, 1024]``, bf16.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from gem_kernels.hstu_gap_grad_rows import silu_grad_rows
from gem_kernels.norm_gate_triton import NormGateFunction, norm_gate_backward

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import cell, rotated_rounds, save_results, spread  # beside this script

HV = 1024
WIDTH = 4 * HV


def inputs(rows: int, device: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).bfloat16().to(device)

    t = {"pre": r(rows, WIDTH, scale=2.0), "attn": r(rows, HV), "dy": r(rows, HV), "d_pre": r(rows, WIDTH)}
    t["weight"] = torch.randn(HV, generator=gen).to(device)
    t["bias"] = torch.randn(HV, generator=gen).to(device)
    _, t["mean"], t["rstd"] = NormGateFunction.run_forward(t["attn"], t["pre"][:, :HV], t["weight"], t["bias"],
                                                           1e-5, silu_gate=True)  # fmt: skip
    return t


def variant(t: dict[str, torch.Tensor], in_norm_gate: bool) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
    """The gap's two kernels into ``t["d_pre"]`` (its ``v, q, k`` columns holding the attention's gradients),
    as the gap runs them; returns the completed gradient and its column sums."""

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        d_pre = t["d_pre"]
        u_sums = torch.empty(HV, dtype=torch.float32, device=d_pre.device) if in_norm_gate else None
        norm_gate_backward(t["dy"], t["attn"], t["pre"][:, :HV], t["weight"], t["bias"], t["mean"], t["rstd"],
                           silu_gate=True, du_out=d_pre[:, :HV], du_sum_out=u_sums)  # fmt: skip
        sums = silu_grad_rows(t["pre"], d_pre, HV, None, col_sum=True, u_summed=in_norm_gate)
        if u_sums is not None:
            sums[:HV] = u_sums
        return d_pre, sums

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=207_000)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="a tiny case on the CPU (TRITON_INTERPRET=1): the check alone")
    p.add_argument("--out")
    args = p.parse_args()
    device = "cpu" if args.smoke else "cuda"
    rows = 300 if args.smoke else args.rows
    gen = torch.Generator().manual_seed(2026)
    t = inputs(rows, device, gen)
    pristine = t["d_pre"].clone()
    names = {"in_last_pass": False, "in_norm_gate": True}
    results = {}
    for name, flag in names.items():
        t["d_pre"].copy_(pristine)
        d_pre, sums = variant(t, flag)()
        results[name] = (d_pre.clone(), sums.clone())
    (g0, _), (g1, _) = results.values()
    if not torch.equal(g0, g1):
        raise SystemExit("gap_bias_sums: the two variants wrote different gradients")
    want, scale = g0.double().sum(0), g0.double().abs().sum(0).clamp_min(1.0)  # float32 sums err by ~eps x sum |g|
    errors = {n: float(((s.double() - want).abs() / scale).max()) for n, (_, s) in results.items()}
    if max(errors.values()) > 1e-5:
        raise SystemExit(f"gap_bias_sums: column sums off the float64 sums: {errors}")
    print(f"checked: same gradient bit for bit; column sums' largest relative error {errors}")
    if args.smoke:
        return 0

    fns: dict[str, Callable[[], object]] = {name: variant(t, flag) for name, flag in names.items()}
    times = rotated_rounds(fns, args.rounds)  # the gradient's columns are rewritten in place: same work each call
    rows_out = []
    base = spread(times["in_last_pass"])["median"]
    print(f"\n{rows} rows, d_pre [{rows}, {WIDTH}] bf16, {args.rounds} rounds ({torch.cuda.get_device_name()})")
    print(f"{'variant':<14} {'ms (q1-q3)':>24} {'against in_last_pass':>22}")
    for name, ms in times.items():
        stats = spread(ms)
        rows_out.append({"variant": name, **stats, "speedup": base / stats["median"], "sum_error": errors[name]})
        print(f"{name:<14} {cell(stats):>24} {base / stats['median']:>21.3f}x")
    save_results(args.out, rows_out, rows=rows, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
