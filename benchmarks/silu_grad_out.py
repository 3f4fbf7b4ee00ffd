"""The fused HSTU gap's backward with ``silu'`` in the attention passes' epilogues
(``gem_kernels.hstu_gap_triton.SILU_GRAD_IN_ATTENTION``, :mod:`gem_kernels.silu_grad_out`) against the
last pass over the whole gradient (``silu_grad_rows``), at the big config's shapes, on one GPU.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/silu_grad_out.py --rounds 15 --out s.json

Inputs: ``hstu_gap.py``'s (B=384 histories, P(n) ~ (n + 1)^-0.95 over 1..4095, one target each, H=8,
Dqk=Dv=128, bf16), drawn from ``--seed``, with the ``uvqk`` bias lent to the gap (its gradient summed by
the backward, as the big config runs) and the separate ``dq`` pass (as ``auto`` picks at these
lengths; the epilogue needs it). First both forms' gradients (``pre``, the gate's weight and
bias, the ``uvqk`` bias) are compared on the same inputs: within ``--max-error`` of each other (the
epilogue rounds ``dq``, ``dk``, ``dv`` once where the last pass rounds twice; the bias sums add in
another order). Then the forward and backward are timed, both forms in rotated order, ``--rounds``
rounds after a warm-up call each (every kernel tuned and compiled), as medians with their quartiles;
then the backward's kernels one by one, each with and without its part of the work (:func:`parts`).
"""

from __future__ import annotations

import argparse
import sys

import torch
from rounds import cell, rotated_rounds, save_results, spread

from gem_kernels import hstu_gap_triton as gap
from gem_kernels.testing import relative_error
from gem_model.api import AttentionExtras

NAMES = ("d_pre", "d_gate_weight", "d_gate_bias", "d_uvqk_bias")


def inputs(args: argparse.Namespace, device: torch.device) -> dict:
    B, N, H, D = args.batch, args.max_len, args.heads, args.dim
    gen = torch.Generator().manual_seed(args.seed)
    weights = (torch.arange(N - 1, dtype=torch.float64) + 1) ** -0.95
    lengths = torch.multinomial(weights, B, replacement=True, generator=gen) + 1
    offsets = torch.zeros(B + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    rows = int(offsets[-1])
    dgen = torch.Generator(device).manual_seed(args.seed)
    return dict(
        pre=torch.randn(rows, 4 * H * D, generator=dgen, device=device).to(torch.bfloat16),
        weight=1 + 0.1 * torch.randn(H * D, generator=dgen, device=device),
        bias=0.1 * torch.randn(H * D, generator=dgen, device=device),
        pre_bias=0.1 * torch.randn(4 * H * D, generator=dgen, device=device).to(torch.bfloat16),
        dy=torch.randn(rows, H * D, generator=dgen, device=device).to(torch.bfloat16),
        offsets=offsets.to(device), targets=torch.ones(B, dtype=torch.int64, device=device), rows=rows,
        shape=(N, H, D),
    )


def fwd_bwd(x: dict, in_attention: bool):
    leaves = [t.detach().requires_grad_() for t in (x["pre"], x["weight"], x["bias"], x["pre_bias"])]
    N, H, D = x["shape"]

    def run() -> tuple:
        gap.SILU_GRAD_IN_ATTENTION = in_attention
        y, _ = gap.hstu_gap_triton(leaves[0], leaves[1], leaves[2], x["offsets"], num_heads=H, attention_dim=D,
                                   value_dim=D, max_seq_len=N, alpha=1 / D**0.5, eps=1e-6, pre_bias=leaves[3],
                                   extras=AttentionExtras(num_targets=x["targets"]), dq_mode="separate")  # fmt: skip
        return y, torch.autograd.grad(y, leaves, x["dy"])

    return run


def parts(x: dict) -> dict[str, object]:
    """The backward's kernels one by one on the gap's own tensors, with and without their share of the
    work: the dk/dv pass and the dq pass plain, with the epilogue's ``silu'`` only, or with its sums too, the norm-gate backward with the
    ``u`` column sums or without, and the last pass itself (in place over ``d_pre``, sums only)."""
    from gem_kernels.attention_triton import query_major
    from gem_kernels.attention_triton_bwd import key_major
    from gem_kernels.hstu_gap_grad_rows import silu_grad_rows
    from gem_kernels.norm_gate_triton import norm_gate_backward
    from gem_kernels.silu_grad_out import SiluGradOut

    N, H, D = x["shape"]
    pre, rows, hd = x["pre"], x["rows"], H * D
    d_pre = torch.randn(pre.shape, device=pre.device).to(pre.dtype)
    sums = torch.zeros(4 * hd, device=pre.device)

    def cols(t: torch.Tensor, i: int) -> torch.Tensor:
        return t[:, i * hd:(i + 1) * hd].view(rows, H, D)

    u, (v, q, k) = pre[:, :hd], (torch.nn.functional.silu(cols(pre, i)) for i in (1, 2, 3))
    g = x["dy"].view(rows, H, D)
    kw = dict(max_seq_len=N, alpha=1 / D**0.5, max_attn_len=0)
    offsets, targets = x["offsets"], x["targets"]

    def epi(i: int, summed: bool = True) -> SiluGradOut:
        return SiluGradOut(cols(pre, i), sums[i * hd:(i + 1) * hd] if summed else None)

    attn = torch.randn(rows, hd, device=pre.device).to(pre.dtype)
    mean, rstd = attn.float().mean(1), torch.rsqrt(attn.float().var(1) + 1e-6)
    ng = (x["dy"], attn, u, x["weight"], x["bias"], mean, rstd)
    return {
        "dkdv": lambda: key_major(q, k, v, g, offsets, targets, None, out=(cols(d_pre, 3), cols(d_pre, 1)), **kw),
        "dkdv+epilogue": lambda: key_major(q, k, v, g, offsets, targets, None, out=(cols(d_pre, 3), cols(d_pre, 1)),
                                           silu_pre=(epi(3), epi(1)), **kw),
        "dkdv+silu": lambda: key_major(q, k, v, g, offsets, targets, None, out=(cols(d_pre, 3), cols(d_pre, 1)),
                                       silu_pre=(epi(3, False), epi(1, False)), **kw),
        "dq": lambda: query_major(q, k, v, g, offsets, targets, out=cols(d_pre, 2), **kw),
        "dq+epilogue": lambda: query_major(q, k, v, g, offsets, targets, out=cols(d_pre, 2), silu_pre=epi(2), **kw),
        "dq+silu": lambda: query_major(q, k, v, g, offsets, targets, out=cols(d_pre, 2), silu_pre=epi(2, False), **kw),
        "norm_gate_bwd": lambda: norm_gate_backward(*ng, silu_gate=True, du_out=d_pre[:, :hd]),
        "norm_gate_bwd+sums": lambda: norm_gate_backward(*ng, silu_gate=True, du_out=d_pre[:, :hd], du_sums=sums[:hd]),
        "last_pass": lambda: silu_grad_rows(pre, d_pre, hd, None, col_sum=True),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--max-error", type=float, default=1e-2)
    p.add_argument("--batch", type=int, default=384)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--check-only", action="store_true", help="compare the two forms, time nothing (the CPU's test)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    x = inputs(args, device)
    runs = {"last_pass": fwd_bwd(x, False), "in_attention": fwd_bwd(x, True)}
    (y_a, g_a), (y_b, g_b) = runs["last_pass"](), runs["in_attention"]()
    errors = {"y": relative_error(y_b, y_a)} | {n: relative_error(b, a) for n, a, b in zip(NAMES, g_a, g_b)}
    print("in_attention against last_pass, relative errors:", {k: f"{v:.2e}" for k, v in errors.items()}, flush=True)
    bad = {k: v for k, v in errors.items() if not v <= args.max_error}
    if bad:
        print(f"FAILED: above {args.max_error}: {bad}", file=sys.stderr)
        if not args.check_only:
            save_results(args.out, [], rows=x["rows"], errors=errors, failed=bad)
        return 1
    if args.check_only:
        return 0
    times = rotated_rounds(runs, args.rounds)
    stats = {n: spread(t) for n, t in times.items()}
    base = stats["last_pass"]["median"]
    print(f"\nrows {x['rows']:,}, seed {args.seed}; forward + backward ms, median (q1-q3) of {args.rounds} rotated rounds")
    for name, s in stats.items():
        print(f"{name:<14} {cell(s):>26}  {base / s['median']:.3f}x")
    kernels = {n: spread(t) for n, t in rotated_rounds(parts(x), args.rounds).items()}
    print(f"\nthe backward's kernels alone, ms, median (q1-q3) of {args.rounds} rotated rounds")
    for name, s in kernels.items():
        print(f"{name:<20} {cell(s):>26}")
    save_results(args.out, [{"variant": n, **s} for n, s in stats.items()], rows=x["rows"], seed=args.seed,
                 errors=errors, kernels=kernels)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
