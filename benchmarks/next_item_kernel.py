"""The next-item loss kernels, forward and backward on the same data: the core's ``torch`` (chunked
GEMMs and per-row torch passes) against gem-kernels' ``triton`` (three fused kernels).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/next_item_kernel.py --out next_item_kernel.json
    python benchmarks/next_item_kernel.py --smoke     # a CPU check of the script (TRITON_INTERPRET=1)
    python benchmarks/next_item_kernel.py --tiles --out tiles.json   # the triton kernel's tile sizes


Lengths as ``configs/h200-large.yaml`` draws them (P(n) ~ (n + 1)^-s over 0..4095) for B = 384, s = 0.95,
and the second mix of ``benchmarks/results/e2e_ab.md`` (B = 256, s = 0.7); D = 1024, K = 128, L2,
temperature 0.05, queries bf16, items and negatives fp32 (the tables), host lengths given (as the
model passes them). First the triton kernel is run twice (the script exits unless both calls give the
same bits) and the two kernels' loss and gradients are compared on fresh random data (it exits if
they differ by more than the stated bounds), then both are timed with CUDA
events in rotated order: medians with quartiles, and the triton/torch ratio per round. With
``--tiles`` the triton kernel alone runs under each candidate of :data:`TILES` (rows per tile, columns
per step, warps), checked against the shipped tiles first, then all timed in rotated rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from gem_kernels import next_item_loss_triton as fused
from gem_kernels.next_item_loss import TritonNextItemLoss
from gem_kernels.testing import relative_error
from gem_model.api import NextItemLossKernel
from gem_model.model.next_item import TorchNextItemLoss

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import rotated_rounds, save_results  # beside this script

CASES = {"big": (384, 0.95), "mix2": (256, 0.7)}
BOUNDS = {"loss": 1e-4, "query": 2e-2, "items": 1e-3, "negatives": 2e-2}
"""Largest relative (Frobenius) difference between the kernels: bf16 score gradients in both."""
TILES = [(32, 64, 4), (64, 64, 4), (32, 32, 4), (32, 128, 4), (16, 64, 4), (32, 64, 8), (128, 32, 8)]
"""(BLOCK_M, BLOCK_D, warps) candidates for ``--tiles``; the first is the shipped one."""


def data(batch: int, exponent: float, max_len: int, dim: int, k: int, dev: torch.device, gen: torch.Generator,
         min_len: int = 0):
    """Power-law lengths of at least ``min_len`` (the smoke run's 4 sequences take 2: a draw of lengths
    0 and 1 only has no next item, and the loss then uses no item row)."""
    n = torch.arange(max_len + 1, dtype=torch.float64)
    lengths = torch.multinomial((n + 1) ** -exponent, batch, replacement=True, generator=gen).clamp_min(min_len)
    rows = int(lengths.sum())
    query = torch.randn(rows, dim, generator=gen).to(dev, torch.bfloat16)
    items = (0.1 * torch.randn(rows, dim, generator=gen)).to(dev)
    negatives = (0.1 * torch.randn(batch * k, dim, generator=gen)).to(dev)
    item_ids = torch.randint(10**4, (rows,), generator=gen).to(dev)
    negative_ids = torch.randint(10**4, (batch * k,), generator=gen).to(dev)  # some negatives hit the positive
    return (query, items, negatives, lengths.to(dev), item_ids, negative_ids), lengths


def step(kernel: NextItemLossKernel, args: tuple, host: torch.Tensor, k: int) -> Callable[[], list[torch.Tensor]]:
    leaves = [t.detach().requires_grad_() for t in args[:3]]

    def run() -> list[torch.Tensor]:
        loss, _ = kernel(*leaves, *args[3:], num_negatives=k, per_position=False, l2_normalize=True,
                         temperature=0.05, host_lengths=host)  # fmt: skip
        return [loss.detach(), *torch.autograd.grad(loss, leaves)]

    return run


def tiled(run: Callable[[], list[torch.Tensor]], block_m: int, block_d: int, warps: int) -> Callable[[], list[torch.Tensor]]:
    """``run`` with the triton kernels' module constants set to these tiles for the call."""

    def call() -> list[torch.Tensor]:
        saved = fused.BLOCK_M, fused.BLOCK_D, fused._warps
        fused.BLOCK_M, fused.BLOCK_D, fused._warps = block_m, block_d, lambda _block_k: warps
        try:
            return run()
        finally:
            fused.BLOCK_M, fused.BLOCK_D, fused._warps = saved

    return call


def sweep(fn: Callable[[], list[torch.Tensor]], rounds: int, case: str, timed: bool) -> dict:
    """Every tile candidate checked against the shipped one, then (``timed``) timed in rotated rounds."""
    fns = {f"m{m} d{d} w{w}": tiled(fn, m, d, w) for m, d, w in TILES}
    shipped = fns[next(iter(fns))]()
    for name, f in fns.items():
        diffs = [relative_error(g, w) for g, w in zip(f(), shipped, strict=True)]
        if any(not v <= 1e-3 for v in diffs):
            raise SystemExit(f"{case} {name}: outputs differ from the shipped tiles: {diffs}")
    if not timed:
        return {}
    return medians(rotated_rounds(fns, rounds))


def medians(times: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each variant's median and quartiles (ms), printed as a row each."""
    out = {}
    for name, ms in times.items():
        q1, med, q3 = statistics.quantiles(ms, n=4)
        out[name] = {"median_ms": med, "q1_ms": q1, "q3_ms": q3}
        print(f"  {name:14s} {med:8.3f} ms ({q1:.3f}-{q3:.3f})")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--negatives", type=int, default=128)
    p.add_argument("--out")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU, no timing")
    p.add_argument("--tiles", action="store_true", help="time the triton kernel's tile candidates instead")
    args = p.parse_args()
    dev = torch.device("cpu" if args.smoke else "cuda")
    dim, k, max_len = (24, 5, 40) if args.smoke else (args.dim, args.negatives, 4095)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    kernels = {"torch": TorchNextItemLoss(), "triton": TritonNextItemLoss()}
    results = []
    for case, (batch, exponent) in CASES.items():
        batch = 4 if args.smoke else batch
        inputs, host = data(batch, exponent, max_len, dim, k, dev, gen, min_len=2 if args.smoke else 0)
        fns = {name: step(kernel, inputs, host, k) for name, kernel in kernels.items()}
        want, got = fns["torch"](), fns["triton"]()
        again = fns["triton"]()  # no atomics: a second call must give the same bits
        if not all(torch.equal(a, b) for a, b in zip(got, again, strict=True)):
            worst = [float((a.double() - b.double()).abs().max()) for a, b in zip(got, again, strict=True)]
            raise SystemExit(f"{case}: two triton calls on the same inputs differ (largest |difference| of loss, "
                             f"query, items, negatives: {worst})")  # fmt: skip
        diffs = {n: relative_error(g, w) for n, g, w in zip(("loss", "query", "items", "negatives"), got, want, strict=True)}
        print(f"{case}: B {batch}, {int(host.sum())} rows; triton against torch: "
              + ", ".join(f"{n} {v:.2e}" for n, v in diffs.items()))  # fmt: skip
        if any(not diffs[n] <= BOUNDS[n] for n in BOUNDS):
            raise SystemExit(f"{case}: the kernels differ beyond {BOUNDS}: {diffs}")
        if args.tiles:
            results.append({"case": case, "batch": batch, "rows": int(host.sum()),
                            "tiles": sweep(fns["triton"], args.rounds, case, timed=not args.smoke)})  # fmt: skip
            continue
        if args.smoke:
            continue
        times = rotated_rounds(fns, args.rounds)
        ratio = [a / b for a, b in zip(times["torch"], times["triton"], strict=True)]
        row = {"case": case, "batch": batch, "rows": int(host.sum()), "differences": diffs,
               "ratio_median": statistics.median(ratio), **medians(times)}  # fmt: skip
        print(f"  torch / triton per round: median {row['ratio_median']:.2f}x")
        results.append(row)
    save_results(args.out, results, dim=dim, negatives=k, rounds=args.rounds)


if __name__ == "__main__":
    main()
