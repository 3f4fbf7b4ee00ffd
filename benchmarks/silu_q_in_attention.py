"""The fused HSTU gap's forward with the queries' silu computed by the attention forward as it loads each
query tile (``in_attention``: ``hstu_gap_triton.SILU_Q_IN_ATTENTION``, the silu pass covering ``v`` and
``k`` only) against the silu pass over ``v, q, k`` (``by_pass``). Both give the same output and the same
gradients, bit for bit (checked first, forward and backward, on fresh random data); then the forward,
and the forward with backward, are timed alone with CUDA events, the variants in rotated order round after
round, and reported as medians with their spread.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/silu_q_in_attention.py --out silu_q.json
    TRITON_INTERPRET=1 python benchmarks/silu_q_in_attention.py --smoke      # a CPU check of the script

Shapes of ``configs/h200-large.yaml`` (``benchmarks/hstu_gap.py``'s: 384 histories with P(n) ~ (n + 1)^-0.95
up to 4,095 rows and a target each, 8 heads of 128, ``pre`` in bf16); ``--seed`` draws other lengths and values.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import gem_kernels.hstu_gap_triton as gap
from gem_model.api import AttentionExtras

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import cell, rotated_rounds, save_results, spread  # beside this script

VARIANTS = {"by_pass": False, "in_attention": True}


def inputs(seed: int, batch: int, max_len: int, heads: int, dim: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(seed)
    weights = (torch.arange(max_len - 1, dtype=torch.float64) + 1) ** -0.95
    lengths = torch.multinomial(weights, batch, replacement=True, generator=gen) + 1
    offsets = torch.zeros(batch + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    rows, hv = int(offsets[-1]), heads * dim
    return dict(
        pre=(torch.randn(rows, 4 * hv, generator=gen) * 2).bfloat16().to(device),
        weight=(1 + 0.1 * torch.randn(hv, generator=gen)).to(device),
        bias=(0.1 * torch.randn(hv, generator=gen)).to(device),
        dy=torch.randn(rows, hv, generator=gen).bfloat16().to(device),
        offsets=offsets.to(device), targets=torch.ones(batch, dtype=torch.int64, device=device), rows=rows,
        heads=heads, dim=dim, max_len=max_len,
    )  # fmt: skip


def run(x: dict, in_attention: bool, backward: bool) -> Callable[[], tuple]:
    """The gap with the flag as given, forward alone (no autograd) or forward and backward."""
    leaves = [t.detach().requires_grad_(backward) for t in (x["pre"], x["weight"], x["bias"])]

    def call() -> tuple:
        gap.SILU_Q_IN_ATTENTION = in_attention
        with torch.set_grad_enabled(backward):
            y, _ = gap.hstu_gap_triton(*leaves, x["offsets"], num_heads=x["heads"], attention_dim=x["dim"],
                                       value_dim=x["dim"], max_seq_len=x["max_len"], alpha=x["dim"] ** -0.5, eps=1e-6,
                                       extras=AttentionExtras(num_targets=x["targets"]))  # fmt: skip
            return (y, *torch.autograd.grad(y, leaves, x["dy"])) if backward else (y,)

    return call


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="a tiny case on the CPU (TRITON_INTERPRET=1): the check alone")
    p.add_argument("--out")
    args = p.parse_args()
    shipped = gap.SILU_Q_IN_ATTENTION
    try:
        if args.smoke:
            x = inputs(args.seed, 4, 12, 2, 16, "cpu")
        else:
            x = inputs(args.seed, 384, 4096, 8, 128, "cuda")
        for backward in (False, True):
            outs = {name: run(x, flag, backward)() for name, flag in VARIANTS.items()}
            for i, (a, b) in enumerate(zip(*outs.values(), strict=True)):
                if not (torch.isfinite(a).all() and torch.equal(a, b)):
                    raise SystemExit(f"silu_q_in_attention: output {i} (backward={backward}) differs between the variants")
        print(f"checked: {x['rows']} rows, the same output and gradients bit for bit")
        if args.smoke:
            return 0
        results = []
        for kind, backward in (("forward", False), ("forward_backward", True)):
            times = rotated_rounds({name: run(x, flag, backward) for name, flag in VARIANTS.items()}, args.rounds)
            base = spread(times["by_pass"])["median"]
            print(f"\n{kind}: {x['rows']} rows, {args.rounds} rounds ({torch.cuda.get_device_name()})")
            for name, ms in times.items():
                stats = spread(ms)
                results.append({"kind": kind, "variant": name, **stats, "speedup": base / stats["median"]})
                print(f"  {name:<13} {cell(stats):>24} ms  {base / stats['median']:.3f}x by_pass")
        save_results(args.out, results, rows=x["rows"], rounds=args.rounds, seed=args.seed)
        return 0
    finally:
        gap.SILU_Q_IN_ATTENTION = shipped


if __name__ == "__main__":
    raise SystemExit(main())
