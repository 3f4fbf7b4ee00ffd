"""The sequence tower's last step, its final layer norm and history pooling, forward and backward: the
torch ops the model runs today against ``gem_kernels.sequence_pool_triton``, as device time.

- ``torch``: gem-model's kernel (``gem_model.model.sequence_pool.sequence_pool_torch``, lead 0, a candidate):
  the layer norm (its float32 weight and bias cast to the rows' bf16), the history rows' index (arange +
  repeat_interleave), ``jagged.split_rows`` into the history and each sequence's last row,
  ``jagged.segment_mean`` of the history (the membership GEMM on the GPU);
- ``triton``: ``sequence_pool_triton`` (a forward pass over the rows, a small kernel adding each
  sequence's column sums, a backward pass over the rows).

The big config's shape: B = 384 sequences with history lengths drawn as ``configs/h200-large.yaml``'s
synthetic source does (P(n) ~ (n + 1)^-0.95 over 0..4095), each plus its candidate; D = 1024, bf16 rows,
float32 weight and bias, max_len 4096. Both are checked first on fresh random data against float64
(the three outputs and the gradients of x, weight and bias); then forward alone and forward + backward
in interleaved rounds (the variants' order rotated), median and IQR, ``--iters`` calls a round queued
behind a ``torch.cuda._sleep``.

    python benchmarks/sequence_pool.py --rounds 15 --out sequence_pool.json
    TRITON_INTERPRET=1 python benchmarks/sequence_pool.py --device cpu --batch 4 --max-len 16  # the check only
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from op_pair import (  # benchmarks/op_pair.py, beside this script
    add_case_args,
    check_errors,
    history_lengths,
    relative,
    time_passes,
)
from rounds import save_results  # benchmarks/rounds.py, beside this script

from gem_kernels.sequence_pool_triton import sequence_pool_reference, sequence_pool_triton
from gem_model.jagged import offsets_of
from gem_model.model.hstu import LayerNorm
from gem_model.model.sequence_pool import sequence_pool_torch

OUTPUTS = ("hist", "last", "mean", "dx", "dweight", "dbias")


class Case:
    """Fresh random rows, layer-norm parameters and output gradients on ``args.device``."""

    def __init__(self, args: argparse.Namespace) -> None:
        gen = torch.Generator().manual_seed(args.seed)
        hist_lengths = history_lengths(args, gen)
        rows, b = int(hist_lengths.sum()) + args.batch, args.batch
        self.rows, self.max_len, dev = rows, args.max_len, args.device
        self.hist_lengths = hist_lengths.to(dev)
        self.offsets = offsets_of(self.hist_lengths + 1)
        scale, shift = torch.rand(rows, 1, generator=gen) * 3, torch.randn(rows, 1, generator=gen)
        x = torch.randn(rows, args.dim, generator=gen) * scale + shift
        self.x = x.to(device=dev, dtype=torch.bfloat16).requires_grad_()
        self.norm = LayerNorm(args.dim).to(dev)
        with torch.no_grad():
            self.norm.weight.copy_(torch.randn(args.dim, generator=gen))
            self.norm.bias.copy_(torch.randn(args.dim, generator=gen))
        shapes = ((rows - b, args.dim), (b, args.dim), (b, args.dim))
        self.grads = [torch.randn(s, generator=gen).to(device=dev, dtype=torch.bfloat16) for s in shapes]
        self.leaves = (self.x, self.norm.weight, self.norm.bias)

    def torch_path(self) -> tuple[torch.Tensor, ...]:
        """gem-model's ``torch`` kernel, the ops ``encode()`` ran before the op existed (lead 0, a candidate)."""
        return sequence_pool_torch(self.x, self.norm.weight, self.norm.bias, self.norm.eps, self.offsets,
                                   self.hist_lengths, lead=0, candidate=True)  # fmt: skip

    def triton_path(self) -> tuple[torch.Tensor, ...]:
        return sequence_pool_triton(self.x, self.norm.weight, self.norm.bias, self.norm.eps, self.offsets, lead=0,
                                    candidate=True, max_len=self.max_len)  # fmt: skip

    def forward(self, path: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[[], object]:
        return path

    def step(self, path: Callable[[], tuple[torch.Tensor, ...]]) -> Callable[[], object]:
        """Forward and backward, the three outputs' gradients given (as the model's loss gives them)."""

        def run() -> None:
            for t in self.leaves:
                t.grad = None
            torch.autograd.backward(path(), self.grads)

        return run

    def errors(self) -> dict[str, dict[str, float]]:
        """Each path's relative errors against the reference computed in float64."""
        exact = [t.detach().double().requires_grad_() for t in self.leaves]
        eps, offsets = self.norm.eps, self.offsets
        want = sequence_pool_reference(*exact, eps, offsets, lead=0, candidate=True, max_len=self.max_len)
        want_grads = torch.autograd.grad(want, exact, [g.double() for g in self.grads])
        wanted = [w.detach() for w in want] + list(want_grads)
        del exact, want
        out = {}
        for name, path in (("torch", self.torch_path), ("triton", self.triton_path)):
            outs = path()
            got = [o.detach() for o in outs] + list(torch.autograd.grad(outs, self.leaves, self.grads))
            out[name] = {k: relative(g, w) for k, g, w in zip(OUTPUTS, got, wanted, strict=True)}
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_case_args(parser)
    # torch's layer norm runs with its weight and bias cast to bf16, so their gradients are bf16 sums (on
    # the CPU, 0.04 off float64 at 2,000 rows): the baseline is checked for computing the same thing
    parser.add_argument("--max-error-torch", type=float, default=0.1)
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        print("sequence_pool.py times CUDA kernels: no GPU here", file=sys.stderr)
        return 1
    case = Case(args)
    errors = case.errors()
    print(f"{case.rows} rows, {case.rows - args.batch} history rows, {args.batch} sequences, D = {args.dim}")
    check_errors(errors, OUTPUTS, {"torch": args.max_error_torch, "triton": args.max_error})
    if args.device == "cpu":
        print("cpu: errors checked; timing needs a GPU")
        return 0
    results = time_passes(case, args, errors)
    save_results(args.out, results, batch=args.batch, max_len=args.max_len, exponent=args.exponent, dim=args.dim,
                 rows=case.rows, rounds=args.rounds, iters=args.iters, seed=args.seed)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
