"""The HSTU gap (silu, split, attention, norm-gate) on one GPU: fused (gem_kernels.hstu_gap_triton)
against the same Triton kernels composed op by op, at the big config's shapes.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/hstu_gap.py --out gap.json

Inputs: B=384 histories with P(n) ~ (n + 1)^-0.95 over 1..4095 plus one target each (the lengths of
configs/h200-large.yaml), H=8, Dqk=Dv=128, ``pre`` ~ N(0, 1) in bf16, seed 7. First the fused output and
its three gradients (pre, gate weight, gate bias) are checked against the composed ops on the same
inputs; then forward and forward+backward are timed (``triton.testing.do_bench`` medians, fused and
composed interleaved, after both ran once, so every kernel is tuned and compiled).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from gem_kernels.attention_triton_autograd import jagged_attention_triton
from gem_kernels.hstu_gap_triton import hstu_gap_triton
from gem_kernels.norm_gate_triton import norm_gate_triton
from gem_kernels.testing import relative_error
from gem_model.api import AttentionExtras

B, H, D, N = 384, 8, 128, 4096


def big_config_offsets(seed: int = 7) -> torch.Tensor:
    """``[B + 1]`` offsets of B sequences with P(n) ~ (n + 1)^-0.95 over 1..4095 rows (their last row the target)."""
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.arange(N - 1, dtype=torch.float64) + 1) ** -0.95
    lengths = torch.multinomial(weights, B, replacement=True, generator=gen) + 1
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return offsets


def inputs(device: torch.device) -> dict:
    offsets = big_config_offsets()
    rows = int(offsets[-1])
    dgen = torch.Generator(device).manual_seed(7)
    return dict(
        pre=torch.randn(rows, 4 * H * D, generator=dgen, device=device).to(torch.bfloat16),
        weight=1 + 0.1 * torch.randn(H * D, generator=dgen, device=device),
        bias=0.1 * torch.randn(H * D, generator=dgen, device=device),
        dy=torch.randn(rows, H * D, generator=dgen, device=device).to(torch.bfloat16),
        offsets=offsets.to(device), targets=torch.ones(B, dtype=torch.int64, device=device), rows=rows,
    )


def fused(x: dict, pre: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    y, _ = hstu_gap_triton(pre, weight, bias, x["offsets"], num_heads=H, attention_dim=D, value_dim=D, max_seq_len=N,
                           alpha=1 / D**0.5, eps=1e-6, extras=AttentionExtras(num_targets=x["targets"]))  # fmt: skip
    return y


def composed(x: dict, pre: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    n = pre.shape[0]
    u, v, q, k = torch.split(F.silu(pre), [H * D] * 4, dim=-1)
    a = jagged_attention_triton(q.reshape(n, H, D), k.reshape(n, H, D), v.reshape(n, H, D), x["offsets"],
                                max_seq_len=N, alpha=1 / D**0.5, extras=AttentionExtras(num_targets=x["targets"]))  # fmt: skip
    return norm_gate_triton(a.reshape(n, H * D), u, weight, bias, 1e-6)


def fwd_bwd(fn, x: dict):
    leaves = [t.detach().requires_grad_() for t in (x["pre"], x["weight"], x["bias"])]

    def run():
        y = fn(x, *leaves)
        return y, torch.autograd.grad(y, leaves, x["dy"])

    return run


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out")
    args = p.parse_args()
    device = torch.device("cuda")
    x = inputs(device)
    runs = {"fused": fwd_bwd(fused, x), "composed": fwd_bwd(composed, x)}
    (y_f, g_f), (y_c, g_c) = runs["fused"](), runs["composed"]()
    errors = {"y": relative_error(y_f, y_c)} | {
        n: relative_error(a, b) for n, a, b in zip(("d_pre", "d_weight", "d_bias"), g_f, g_c)
    }
    print("fused against composed, relative errors:", {k: f"{v:.2e}" for k, v in errors.items()}, flush=True)
    ok = all(e < 2e-2 for e in errors.values())
    times: dict[str, list[float]] = {f"{n}_{kind}": [] for n in runs for kind in ("fwd", "fwd_bwd")}
    with torch.no_grad():
        forwards = {n: (lambda f=f: f(x, x["pre"], x["weight"], x["bias"])) for n, f in (("fused", fused), ("composed", composed))}
    for _ in range(3):  # interleaved repeats
        for name in runs:
            with torch.no_grad():
                times[f"{name}_fwd"].append(do_bench(forwards[name], warmup=25, rep=200))
            times[f"{name}_fwd_bwd"].append(do_bench(runs[name], warmup=25, rep=400))
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    print(f"\nrows {x['rows']:,}; ms (median of 3 interleaved do_bench medians)")
    print(f"{'':<10} {'forward':>9} {'fwd+bwd':>9}")
    for name in runs:
        print(f"{name:<10} {med[name + '_fwd']:>9.3f} {med[name + '_fwd_bwd']:>9.3f}")
    print(f"speed-up  {med['composed_fwd'] / med['fused_fwd']:>9.3f} {med['composed_fwd_bwd'] / med['fused_fwd_bwd']:>9.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                       "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "rows": x["rows"],
                       "errors": errors, "times_ms": times, "median_ms": med}, f, indent=1)  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
