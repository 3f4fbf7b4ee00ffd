"""The jagged attention kernels with their inner-loop tiles loaded by tensor descriptors (TMA) against
pointer loads, on the same inputs, interleaved.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/attention_loads.py --rounds 15 \\
        --out attention_loads.json
    TRITON_INTERPRET=1 ... python benchmarks/attention_loads.py --smoke   # the checks on tiny inputs, no timing

Inputs are laid out as the HSTU block hands them to attention: q, k and v are column slices of one
``[L, 3 H D]`` activation (so their rows are ``3 H D`` apart), the output gradient a ``[L, H D]``
tensor; values uniform in (-1, 1), fresh per case. Cases: ``big_config`` (the lengths of
``configs/h200-large.yaml``: B 384, H 8, D 128, power-law lengths up to 4,096 with one target each),
NVIDIA's fixed lengths (B 512, H 4, N 1,024 and 4,096) and short uniform ones (N 1,024, s 0.3).

Checks before timing, per case: with the tile shapes fixed, the forward output, ``dq`` (its
query-major pass) and ``dk``, ``dv`` (the key-major pass) of the two load modes are bitwise equal
(rows past a sequence's end that a descriptor reads are masked), and each tuned mode's output
agrees with the other's to bf16 rounding. Timing: each kernel alone (forward, dq pass, dk/dv pass),
each mode tuned for itself first (the tuning key holds the load mode), then ``--rounds`` rounds in
rotated order; medians and quartiles in ms, and the speed-up of TMA (pointers' median over TMA's).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jagged_attention import CASES, Case, sample_lengths
from rounds import cell, rotated_rounds, save_results, spread

from gem_kernels import attention_triton_bwd, attention_triton_common
from gem_kernels.attention_triton import DQ, FORWARD, query_major
from gem_kernels.attention_triton_bwd import DKDV, key_major

MODES = {"pointers": False, "tma": True}
TIMED_CASES = ("big_config", "fixed1024", "fixed4096", "n1024_s0.3")
SMOKE_CASE = Case(5, 2, 32, 70, 0.6, lengths="powerlaw")
SEED = 2026
TUNED = {"forward": FORWARD, "dq": DQ, "dkdv": DKDV}


def make_inputs(case: Case, device: torch.device, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    lengths = sample_lengths(case, gen)
    targets = None if case.lengths == "fixed" else torch.ones_like(lengths)
    offsets = torch.zeros(case.batch + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    rows, width = int(offsets[-1]), case.heads * case.dim
    dev_gen = torch.Generator(device).manual_seed(seed)
    act = (torch.rand(rows, 3 * width, generator=dev_gen, device=device) * 2 - 1).to(torch.bfloat16)
    q, k, v = (act[:, i * width:(i + 1) * width].view(rows, case.heads, case.dim) for i in range(3))
    grad = (torch.rand(rows, case.heads, case.dim, generator=dev_gen, device=device) * 2 - 1).to(torch.bfloat16)
    return dict(q=q, k=k, v=v, grad=grad, offsets=offsets.to(device),
                targets=None if targets is None else targets.to(device), rows=rows,
                squares=float((lengths.double() ** 2).sum()))


def kernels(case: Case, x: dict[str, Any], blocks: dict[str, tuple[int, int] | None]) -> dict[str, Callable[[], Any]]:
    """The three kernels on ``x``: the forward, the dq pass and the dk/dv pass (separate dq)."""
    common = dict(max_seq_len=case.max_seq_len, alpha=1.0 / case.dim, max_attn_len=0)
    q, k, v, g, off, tg = x["q"], x["k"], x["v"], x["grad"], x["offsets"], x["targets"]
    return {
        "forward": lambda: query_major(q, k, v, None, off, tg, blocks=blocks["forward"], **common),
        "dq": lambda: query_major(q, k, v, g, off, tg, blocks=blocks["dq"], **common),
        "dkdv": lambda: key_major(q, k, v, g, off, tg, None, blocks=blocks["dkdv"], **common),
    }


def in_mode(mode: str, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with every kernel's loads in ``mode`` (the dk/dv pass's descriptors too, off by default)."""

    def run() -> Any:
        before = attention_triton_common.TMA_LOADS, attention_triton_bwd.TMA_LOADS
        attention_triton_common.TMA_LOADS = attention_triton_bwd.TMA_LOADS = MODES[mode]
        try:
            return fn()
        finally:
            attention_triton_common.TMA_LOADS, attention_triton_bwd.TMA_LOADS = before
    return run


def as_list(result: Any) -> list[torch.Tensor]:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def check(case: Case, x: dict[str, Any], fixed: tuple[int, int]) -> dict[str, Any]:
    """Bits of the two modes at fixed tiles; the tuned modes against each other (relative error)."""
    report: dict[str, Any] = {}
    assert attention_triton_common.tma_loads(x["k"], x["v"]) and attention_triton_common.tma_loads(x["q"], x["grad"])
    for tiles, label in ((fixed, "fixed"), (None, "tuned")):
        runs = {mode: {name: as_list(in_mode(mode, fn)()) for name, fn in kernels(
            case, x, dict.fromkeys(("forward", "dq", "dkdv"), tiles)).items()} for mode in MODES}
        for name in runs["tma"]:
            for i, (a, b) in enumerate(zip(runs["tma"][name], runs["pointers"][name], strict=True)):
                if not bool(torch.isfinite(a).all()):
                    raise SystemExit(f"{label} tiles, {name}[{i}]: TMA output not finite")
                key = f"{label}_{name}{i}"
                if label == "fixed":
                    report[key + "_equal"] = bool(torch.equal(a, b))
                    if not report[key + "_equal"]:
                        raise SystemExit(f"fixed tiles {fixed}, {name}[{i}]: TMA and pointer loads differ")
                else:
                    err = ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()
                    report[key + "_rel_err"] = err
                    if err > 1e-2:
                        raise SystemExit(f"tuned, {name}[{i}]: TMA against pointers relative error {err:.2e}")
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(TIMED_CASES))
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true", help="the checks on one tiny case (interpreter), no timing")
    args = parser.parse_args()
    if args.smoke:
        x = make_inputs(SMOKE_CASE, torch.device("cpu"), SEED)
        print(check(SMOKE_CASE, x, (16, 16)))
        return 0
    device = torch.device("cuda")
    results = []
    print(f"{'case':<11} {'kernel':<8} {'pointers ms (q1-q3)':>24} {'tma ms (q1-q3)':>24} {'speed-up':>8}  configs")
    for name in args.cases.split(","):
        case = CASES[name]
        x = make_inputs(case, device, SEED)
        report = check(case, x, (64, 64))
        fns = {f"{k}/{mode}": in_mode(mode, fn) for mode in MODES
               for k, fn in kernels(case, x, dict.fromkeys(("forward", "dq", "dkdv"))).items()}
        chosen = {}
        for label, fn in fns.items():  # tunes each (kernel, mode) on this case; the config it chose
            fn()
            tuned = TUNED[label.split("/")[0]].last
            chosen[label] = None if tuned is None else str(tuned[1])
        times = rotated_rounds(fns, args.rounds)
        row: dict[str, Any] = {"case": name, "rows": x["rows"], "squares": x["squares"], "checks": report,
                               "chosen": chosen, "kernels": {}}
        for kernel in ("forward", "dq", "dkdv"):
            stats = {mode: spread(times[f"{kernel}/{mode}"]) for mode in MODES}
            speed = stats["pointers"]["median"] / stats["tma"]["median"]
            row["kernels"][kernel] = {**stats, "speedup": speed}
            print(f"{name:<11} {kernel:<8} {cell(stats['pointers']):>24} {cell(stats['tma']):>24} {speed:>7.3f}x  "
                  f"{chosen[kernel + '/pointers']} / {chosen[kernel + '/tma']}", flush=True)
        results.append(row)
        del x
        torch.cuda.empty_cache()
    save_results(args.out, results, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
