"""The sequence lookup's gradient in one buffer (``gem_model.table_grad``) against by feature (autograd's split
backward and adds, before 2026-12-07), around the two kernels that consume the lookup's rows as the big
config runs them: the ``triton`` sequence input (items, actions, candidates) and next-item loss (the
items as positives, the negatives), its queries taken from the input's history rows.

Both variants run the same forward; in ``one_buffer`` the loss's backward writes the positives' gradient
into the items' rows of the buffer and the input's backward adds its own and writes the action and
candidate rows, where ``by_feature`` returns them to autograd, which adds the items' two gradients and
concatenates the four features' (torch's split backward). The lookup's gradient is checked bit for bit
between the two on fresh random data first; then forward and backward together are timed with CUDA
events, the variants in rotated order round after round, and reported as medians with their spread.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/table_grad.py --out table_grad.json
    TRITON_INTERPRET=1 python benchmarks/table_grad.py --smoke      # a CPU check of the script

Shapes of ``configs/h200-large.yaml``: 384 histories with ``P(n) ~ (n + 1)^-0.95`` over 0..4,095 (mean ~540),
128 shared negatives a sample, rows of 1,024 in bf16, the features laid out as torchrec's lookup returns
them (history items, negatives, candidates, history actions).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from gem_kernels.next_item_loss_triton import shared_negatives_loss
from gem_kernels.sequence_input_triton import sequence_input_triton
from gem_model.api import offsets_of, table_views

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import cell, rotated_rounds, save_results, spread  # beside this script


def histories(batch: int, max_len: int, exponent: float, gen: torch.Generator) -> torch.Tensor:
    """``batch`` lengths drawn with ``P(n) ~ (n + 1)^-exponent`` over ``0 .. max_len``."""
    weights = (torch.arange(max_len + 1, dtype=torch.float64) + 1) ** -exponent
    return torch.multinomial(weights, batch, replacement=True, generator=gen)


class Case:
    """One batch's lookup output and what the two kernels read beside it."""

    def __init__(self, lengths: torch.Tensor, dim: int, k: int, device: str, gen: torch.Generator):
        b, nh = lengths.numel(), int(lengths.sum())
        self.sizes = [nh, b * k, b, nh]
        total = sum(self.sizes)
        self.data = (torch.randn(total, dim, generator=gen) * (0.5 + torch.rand(total, 1, generator=gen))).bfloat16().to(device)
        self.context = torch.randn(b, dim, generator=gen).bfloat16().to(device)
        self.position = (torch.randn(int(lengths.max()) + 2, dim, generator=gen) * 0.1).to(device)
        self.up = torch.randn(nh + 2 * b, dim, generator=gen).bfloat16().to(device)
        self.lengths, self.k = lengths.to(device), k
        self.host_lengths = lengths
        self.offsets = offsets_of(self.lengths)
        self.item_ids = torch.randint(0, 5000, (nh,), generator=gen).to(device)
        self.negative_ids = torch.randint(0, 5000, (b * k,), generator=gen).to(device)
        starts = (self.offsets[:-1] + torch.arange(b, device=device) * 2 + 1).cpu()  # after each context token
        self.history = torch.cat([torch.arange(s, s + n) for s, n in zip(starts.tolist(), lengths.tolist(),
                                                                          strict=True)]).to(device)  # fmt: skip
        self.max_len = int(lengths.max()) + 2
        self.base = self.data.clone().requires_grad_()

    def step(self, one_buffer: bool) -> torch.Tensor:
        """Forward and backward of the two kernels over the lookup's rows; returns the lookup's gradient."""
        self.base.grad = None
        item, neg, cand, action = table_views(self.base, self.sizes) if one_buffer else self.base.split(self.sizes)
        x = sequence_input_triton(item, action, self.lengths, self.offsets, scale=1.0, first=self.context, last=cand,
                                  position=self.position, dtype=torch.bfloat16, max_len=self.max_len)  # fmt: skip
        loss, _ = shared_negatives_loss(x.index_select(0, self.history), item, neg, self.lengths, self.item_ids,
                                        self.negative_ids, num_negatives=self.k, l2_normalize=True, temperature=0.05,
                                        host_lengths=self.host_lengths)  # fmt: skip
        ((x * self.up).float().sum() + loss).backward()
        return self.base.grad  # type: ignore[return-value]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=384)
    p.add_argument("--seed", type=int, default=2026)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="a tiny case on the CPU (TRITON_INTERPRET=1): the check alone")
    p.add_argument("--out")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    if args.smoke:
        case = Case(histories(4, 12, 0.95, gen), 32, 4, "cpu", gen)
    else:
        case = Case(histories(args.batch, 4095, 0.95, gen), 1024, 128, "cuda", gen)
    names = {"by_feature": False, "one_buffer": True}
    grads = {name: case.step(flag).clone() for name, flag in names.items()}
    if not torch.equal(*grads.values()):
        diff = (grads["by_feature"].float() - grads["one_buffer"].float()).abs().max().item()
        raise SystemExit(f"table_grad: the two variants' lookup gradients differ (largest difference {diff:.3g})")
    rows = sum(case.sizes)
    print(f"checked: the same lookup gradient bit for bit ({rows} rows: {case.sizes})")
    if args.smoke:
        return 0

    fns: dict[str, Callable[[], object]] = {name: (lambda flag=flag: case.step(flag)) for name, flag in names.items()}
    times = rotated_rounds(fns, args.rounds)
    base = spread(times["by_feature"])["median"]
    out = []
    print(f"\n{rows} lookup rows (histories {case.sizes[0]}), forward + backward, {args.rounds} rounds "
          f"({torch.cuda.get_device_name()})")  # fmt: skip
    print(f"{'variant':<12} {'ms (q1-q3)':>24} {'against by_feature':>20}")
    for name, ms in times.items():
        stats = spread(ms)
        out.append({"variant": name, **stats, "speedup": base / stats["median"]})
        print(f"{name:<12} {cell(stats):>24} {base / stats['median']:>19.3f}x")
    save_results(args.out, out, rows=rows, sizes=case.sizes, batch=args.batch, seed=args.seed, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
