"""The sequence tower's first step, its rows assembled from the history's embeddings, forward and
backward: the torch ops the model runs today against ``gem_kernels.sequence_input_triton``, as device time.

- ``torch``: gem-model's kernel (``gem_model.model.sequence_input.sequence_input_torch``): the bf16 add of
  the item and action rows, ``jagged.append_one`` of the candidate (an ``index_copy``), the position rows
  gathered from the table cast to bf16 (``position_rows``) and added; backward, their transposes (the
  position table's gradient by the embedding backward's sort);
- ``triton``: ``sequence_input_triton`` (one forward pass writing the rows, one backward pass over their
  gradient), with the history offsets computed in the call as the ``triton`` kernel of the op does.

The big config's shape: B = 384 sequences with history lengths drawn as ``configs/h200-large.yaml``'s
synthetic source does (P(n) ~ (n + 1)^-0.95 over 0..4095), each plus its candidate (``last``), no context
token; D = 1024, bf16 item, action and candidate rows, the float32 position table ``[4096, 1024]``, scale
1, bf16 rows out, max_len 4096. Both are checked first on fresh random data against float64 (x and the
gradients of item, action, candidate and position table); then forward alone and forward + backward in
interleaved rounds (the variants' order rotated), median and IQR, ``--iters`` calls a round queued behind
a ``torch.cuda._sleep``.

    python benchmarks/sequence_input.py --rounds 15 --out sequence_input.json
    python benchmarks/sequence_input.py --sequences 4 --pos-block 32  # the kernel's blocks, not its defaults
    TRITON_INTERPRET=1 python benchmarks/sequence_input.py --device cpu --batch 4 --max-len 16  # the check only
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

from gem_kernels import sequence_input_triton as kernel_module
from gem_kernels.sequence_input_triton import sequence_input_reference, sequence_input_triton
from gem_model.jagged import offsets_of
from gem_model.model.sequence_input import sequence_input_torch

OUTPUTS = ("x", "ditem", "daction", "dlast", "dposition")
BLOCKS = ("CHUNK", "POS_BLOCK", "COL_BLOCK", "SEQUENCES")


class Case:
    """Fresh random item, action and candidate rows, position table and output gradient on ``args.device``."""

    def __init__(self, args: argparse.Namespace) -> None:
        gen = torch.Generator().manual_seed(args.seed)
        hist_lengths = history_lengths(args, gen)
        self.hist_rows, self.max_len, self.scale, dev = int(hist_lengths.sum()), args.max_len, args.scale, args.device
        self.rows = self.hist_rows + args.batch
        self.hist_lengths = hist_lengths.to(dev)

        def rows(count: int, dtype: torch.dtype) -> torch.Tensor:
            t = torch.randn(count, args.dim, generator=gen) * 0.5
            return t.to(device=dev, dtype=dtype).requires_grad_()

        self.item, self.action = rows(self.hist_rows, torch.bfloat16), rows(self.hist_rows, torch.bfloat16)
        self.last = rows(args.batch, torch.bfloat16)
        self.position = rows(args.max_len, torch.float32)  # the table, as the model's nn.Embedding holds it
        self.grad = torch.randn(self.rows, args.dim, generator=gen).to(device=dev, dtype=torch.bfloat16)
        self.leaves = (self.item, self.action, self.last, self.position)

    def torch_path(self) -> torch.Tensor:
        """gem-model's ``torch`` kernel, the ops ``encode()`` ran before the op existed (no context token)."""
        return sequence_input_torch(self.item, self.action, self.hist_lengths, scale=self.scale, first=None,
                                    last=self.last, position=self.position, dtype=torch.bfloat16)  # fmt: skip

    def triton_path(self) -> torch.Tensor:
        return sequence_input_triton(self.item, self.action, self.hist_lengths, offsets_of(self.hist_lengths),
                                     scale=self.scale, first=None, last=self.last, position=self.position,
                                     dtype=torch.bfloat16, max_len=self.max_len)  # fmt: skip

    def forward(self, path: Callable[[], torch.Tensor]) -> Callable[[], object]:
        return path

    def step(self, path: Callable[[], torch.Tensor]) -> Callable[[], object]:
        """Forward and backward, x's gradient given (as the blocks above give it)."""

        def run() -> None:
            for t in self.leaves:
                t.grad = None
            path().backward(self.grad)

        return run

    def errors(self) -> dict[str, dict[str, float]]:
        """Each path's relative errors against the reference computed in float64."""
        exact = [t.detach().double().requires_grad_() for t in self.leaves]
        item, action, last, position = exact
        want = sequence_input_reference(item, action, self.hist_lengths, offsets_of(self.hist_lengths),
                                        scale=self.scale, first=None, last=last, position=position,
                                        dtype=torch.float64, max_len=self.max_len)  # fmt: skip
        wanted = [want.detach(), *torch.autograd.grad(want, exact, self.grad.double())]
        del exact, want
        out = {}
        for name, path in (("torch", self.torch_path), ("triton", self.triton_path)):
            x = path()
            got = [x.detach(), *torch.autograd.grad(x, self.leaves, self.grad)]
            out[name] = {k: relative(g, w) for k, g, w in zip(OUTPUTS, got, wanted, strict=True)}
            del x, got
        return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_case_args(parser)
    parser.add_argument("--scale", type=float, default=1.0, help="the item rows' scale (scale_item_input: sqrt(D))")
    for name in BLOCKS:  # the kernel's block constants, when not its defaults
        parser.add_argument("--" + name.lower().replace("_", "-"), type=int, default=None, help=f"triton's {name}")
    # torch rounds the item + action sum to bf16 before the position row is added (two roundings), and
    # on a GPU sums the table's gradient in the bf16 table's embedding backward: checked for computing
    # the same thing, not for its bits
    parser.add_argument("--max-error-torch", type=float, default=2e-2)
    args = parser.parse_args()
    if args.device != "cpu" and not torch.cuda.is_available():
        print("sequence_input.py times CUDA kernels: no GPU here", file=sys.stderr)
        return 1
    for name in BLOCKS:
        if getattr(args, name.lower()) is not None:
            setattr(kernel_module, name, getattr(args, name.lower()))
    blocks = {name: getattr(kernel_module, name) for name in BLOCKS}
    case = Case(args)
    errors = case.errors()
    print(f"{case.rows} rows, {case.hist_rows} history rows, {args.batch} sequences, D = {args.dim}; triton {blocks}")
    check_errors(errors, OUTPUTS, {"torch": args.max_error_torch, "triton": args.max_error})
    if args.device == "cpu":
        print("cpu: errors checked; timing needs a GPU")
        return 0
    results = time_passes(case, args, errors)
    save_results(args.out, results, batch=args.batch, max_len=args.max_len, exponent=args.exponent, dim=args.dim,
                 scale=args.scale, blocks=blocks, rows=case.rows, rounds=args.rounds, iters=args.iters, seed=args.seed)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
