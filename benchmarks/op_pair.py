"""What the micro-benchmarks of one op's torch and Triton kernels share (``sequence_pool.py``,
``sequence_input.py``): the big config's history lengths, the errors against float64 as a table that
stops the run when a kernel is off, and forward / forward + backward timed in rotated rounds."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, Protocol

import torch
from rounds import cell, rotated_queued_rounds, spread  # benchmarks/rounds.py, beside this script


class PairCase(Protocol):
    def torch_path(self) -> Any: ...
    def triton_path(self) -> Any: ...
    def forward(self, path: Callable[[], Any]) -> Callable[[], object]: ...
    def step(self, path: Callable[[], Any]) -> Callable[[], object]: ...


def add_case_args(parser: argparse.ArgumentParser) -> None:
    """The arguments both benchmarks take: the big config's shape, the rounds, the seed, the output."""
    parser.add_argument("--batch", type=int, default=384)
    parser.add_argument("--max-len", type=int, default=4096, help="max_seq_len: histories of 0 .. max_len - 1 rows")
    parser.add_argument("--exponent", type=float, default=0.95)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--sleep-cycles", type=int, default=100_000_000)
    parser.add_argument("--max-error", type=float, default=1e-2, help="the largest error triton's results may have")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda", help="cpu: the float64 check only (TRITON_INTERPRET=1)")


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """``|got - want| / |want|``, or ``|got - want|`` where ``want`` is all zeros (no history rows)."""
    diff, scale = (got.double() - want).norm().item(), want.norm().item()
    return diff / scale if scale > 0 else diff


def history_lengths(args: argparse.Namespace, gen: torch.Generator) -> torch.Tensor:
    """``args.batch`` history lengths drawn as ``configs/h200-large.yaml``'s synthetic source draws them:
    P(n) ~ (n + 1)^-exponent over 0 .. max_len - 1 (the candidate makes max_len)."""
    n = torch.arange(args.max_len, dtype=torch.float64)
    return torch.multinomial((n + 1) ** -args.exponent, args.batch, replacement=True, generator=gen)


def check_errors(errors: dict[str, dict[str, float]], outputs: tuple[str, ...], limits: dict[str, float]) -> None:
    """Print each variant's errors against float64; stop the run if one is above its limit."""
    print("| variant | " + " | ".join(outputs) + " |\n|---|" + "---|" * len(outputs))
    for name, errs in errors.items():
        print(f"| {name} | " + " | ".join(f"{errs[k]:.1e}" for k in outputs) + " |")
    for name, limit in limits.items():
        if not max(errors[name].values()) <= limit:
            raise SystemExit(f"{name}: errors against float64 above {limit}: {errors[name]}")


def time_passes(case: PairCase, args: argparse.Namespace, errors: dict[str, dict[str, float]]) -> list[dict]:
    """Forward, then forward + backward, of torch against triton in rotated rounds: the printed table,
    and its rows for the JSON."""
    results = []
    print("\n| pass | variant | device ms a call, median (IQR) | vs torch |\n|---|---|---|---|")
    for label, make in (("forward", case.forward), ("forward+backward", case.step)):
        fns = {"torch": make(case.torch_path), "triton": make(case.triton_path)}
        times = rotated_queued_rounds(fns, args.rounds, args.iters, args.sleep_cycles)
        base = spread(times["torch"])["median"]
        for name in fns:
            s = spread(times[name])
            print(f"| {label} | {name} | {cell(s)} | {base / s['median']:.2f}x |")
            results.append({"pass": label, "variant": name, **s, "errors": errors[name]})
    return results
