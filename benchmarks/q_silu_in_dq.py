"""The fused HSTU gap's ``q`` columns completed by the stored ``dq`` pass (``hstu_gap_triton.Q_SILU_IN_DQ``: ``dq``
times ``silu'(pre)`` and its column sums there, the last pass skipping those columns) against the last pass
doing them (the default), over the gap's forward and backward at the big config's shapes.

Both variants are checked first on fresh random data: the same gradient outside the ``q`` columns bit for bit,
the ``q`` columns within one bf16 rounding (one rounding against two), the ``uvqk`` bias's gradient within
the same. Then the gap's forward and backward are timed with CUDA events, the variants in rotated order
round after round, and reported as medians with their spread.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/q_silu_in_dq.py --out q_silu_in_dq.json
    TRITON_INTERPRET=1 python benchmarks/q_silu_in_dq.py --smoke      # a CPU check of the script

Shapes of ``configs/h200-large.yaml``: 384 histories with ``P(n) ~ (n + 1)^-0.95`` over 0..4,095 plus the
candidate, 8 heads of 128, bf16, ``dq_mode="stored"``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from gem_kernels import hstu_gap_triton as gap
from gem_kernels.testing import relative_error
from gem_model.api import offsets_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import cell, rotated_rounds, save_results, spread  # beside this script
from table_grad import histories  # beside this script


class Case:
    """One batch's gap inputs (``pre`` with the ``uvqk`` bias lent to the gap, the norm-gate's weight and
    bias, the output gradient)."""

    def __init__(self, lengths: torch.Tensor, heads: int, dim: int, device: str, gen: torch.Generator):
        rows = int(lengths.sum())
        width = heads * 4 * dim
        self.heads, self.dim, self.max_len = heads, dim, int(lengths.max())
        self.offsets = offsets_of(lengths.to(device))
        self.pre = (torch.randn(rows, width, generator=gen) * 2).bfloat16().to(device).requires_grad_()
        self.bias = (torch.randn(width, generator=gen) * 0.1).to(device).requires_grad_()
        self.weight = torch.randn(heads * dim, generator=gen).bfloat16().to(device)
        self.gate_bias = torch.randn(heads * dim, generator=gen).bfloat16().to(device)
        self.dy = torch.randn(rows, heads * dim, generator=gen).bfloat16().to(device)

    def step(self, on: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The gap's forward and backward with the flag ``on``: ``(d pre, d bias)``."""
        gap.Q_SILU_IN_DQ = on
        y, _ = gap.hstu_gap_triton(self.pre, self.weight, self.gate_bias, self.offsets, num_heads=self.heads,
                                   attention_dim=self.dim, value_dim=self.dim, max_seq_len=self.max_len,
                                   alpha=1 / math.sqrt(self.dim), eps=1e-5, dq_mode="stored", pre_bias=self.bias)  # fmt: skip
        d_pre, d_bias = torch.autograd.grad(y, (self.pre, self.bias), self.dy)
        return d_pre, d_bias


def check(case: Case) -> dict[str, float]:
    """Both variants' gradients against each other; raises SystemExit on a difference past one rounding."""
    (p_off, b_off), (p_on, b_on) = case.step(False), case.step(True)
    hv = case.heads * case.dim
    q = slice(2 * hv, 3 * hv)
    other = torch.ones(p_on.shape[1], dtype=torch.bool, device=p_on.device)
    other[q] = False
    errors = {"q_columns": relative_error(p_on[:, q], p_off[:, q]), "bias": relative_error(b_on, b_off)}
    if not torch.equal(p_on[:, other], p_off[:, other]):
        raise SystemExit("q_silu_in_dq: the gradient outside the q columns differs between the variants")
    if p_on.isnan().any() or max(errors.values()) > 2**-8:
        raise SystemExit(f"q_silu_in_dq: the q columns or the bias gradient differ past one rounding: {errors}")
    return errors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=384)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--smoke", action="store_true", help="a tiny case on the CPU (TRITON_INTERPRET=1): the check alone")
    p.add_argument("--out")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    if args.smoke:
        case = Case(histories(3, 70, 0.5, gen) + 1, 2, 64, "cpu", gen)
    else:
        case = Case(histories(args.batch, 4095, 0.95, gen) + 1, 8, 128, "cuda", gen)
    shipped = gap.Q_SILU_IN_DQ
    try:
        errors = check(case)
        rows = case.pre.shape[0]
        print(f"checked: the same gradient outside q bit for bit; q columns and bias within {errors} ({rows} rows)")
        if args.smoke:
            return 0
        names = {"in_last_pass": False, "in_dq_pass": True}
        fns: dict[str, Callable[[], object]] = {name: (lambda on=on: case.step(on)) for name, on in names.items()}
        times = rotated_rounds(fns, args.rounds)
    finally:
        gap.Q_SILU_IN_DQ = shipped
    base = spread(times["in_last_pass"])["median"]
    out = []
    print(f"\nthe gap forward + backward, {rows} rows, {args.rounds} rounds ({torch.cuda.get_device_name()})")
    print(f"{'variant':<14} {'ms (q1-q3)':>24} {'against in_last_pass':>22}")
    for name, ms in times.items():
        stats = spread(ms)
        out.append({"variant": name, **stats, "speedup": base / stats["median"], "errors": errors})
        print(f"{name:<14} {cell(stats):>24} {base / stats['median']:>21.3f}x")
    save_results(args.out, out, rows=rows, batch=args.batch, seed=args.seed, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
