"""The Gluon attention forward (gem_kernels.attention_gluon) against the Triton forward, on one sm_90 GPU.

Cases are benchmarks/jagged_attention.py's: ``big_config`` (B=384, H=8, D=128, power-law lengths up to
4096 with one target: configs/h200-large.yaml's), ``fixed1024/2048/4096`` (B=512, H=4, D=128, every
sequence N long: NVIDIA's uniform-length protocol), ``n1024_s0.3`` (short histories), plus ``edges``:
lengths around the tiles' sizes (0, 1, 63, 64, 65, 127, 128, 129, 191, 4095, ...) with 0-20 targets.

Inputs are fresh random draws per case (``--seed``; seeded from the clock when not given, and printed):
q, k, v = silu of N(0, 1), as the fused block's silu pass writes them, alpha = 1/sqrt(D).

First the check, per case and Gluon config, before any timing:

* the Gluon output over the whole batch against the Triton forward's, into a NaN-filled output (a row
  left unwritten fails): relative error at most ``--max-error`` (default 1e-2: the two round ``P`` to
  bf16 in the same places, and sum in a different order);
* both against float64 on the first sequences (jagged_attention_reference): Gluon's error at most twice
  Triton's plus 1e-3.

The backward's ``dq`` pass (``attention_gluon.dq``, ``--dq-configs``) is checked the same way against
the Triton ``dq`` pass and the float64 gradient of ``q``.

Then the forward (and the ``dq`` pass) is timed: every config and the Triton kernel in rotated order over ``--rounds`` rounds
(``rounds.rotated_rounds``: CUDA events, one warm-up call each, which compiles and tunes), as medians
with their quartiles, and TFLOP/s by jagged_attention.py's count (the causal half of each sequence).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/attention_gluon.py --out attention_gluon.json

Exit status 1 when a check fails; ``--cases`` and ``--configs`` narrow the run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jagged_attention import CASES, Case, flops, sample_lengths
from rounds import cell, rotated_rounds, save_results, spread

from gem_kernels import attention_gluon
from gem_kernels.attention_triton import query_major
from gem_kernels.reference import jagged_attention_reference
from gem_kernels.testing import relative_error
from gem_model.api import AttentionExtras

DEFAULT_CASES = ("edges", "big_config", "n1024_s0.3", "fixed1024", "fixed2048", "fixed4096")
EDGE_LENGTHS = (0, 1, 2, 63, 64, 65, 127, 128, 129, 191, 255, 256, 257, 1000, 4095, 0, 77, 300)
REFERENCE_ROWS = 6000  # rows of the first sequences checked against float64 (its [n, n] scores in memory)


def case_lengths(name: str, gen: torch.Generator) -> tuple[Case, torch.Tensor, torch.Tensor]:
    """The case, its lengths and its targets (jagged_attention.py's rules; ``edges`` its own)."""
    if name == "edges":
        lengths = torch.tensor(EDGE_LENGTHS, dtype=torch.int64)
        case = Case(len(EDGE_LENGTHS), 3, 128, 4096, 1.0)
        return case, lengths, torch.minimum(torch.randint(0, 21, (len(lengths),), generator=gen), lengths)
    case = CASES[name]
    lengths = sample_lengths(case, gen)
    if case.lengths == "fixed":
        targets = torch.zeros_like(lengths)
    elif case.lengths == "powerlaw":
        targets = torch.ones_like(lengths)
    else:
        targets = torch.minimum(torch.randint(1, 21, (case.batch,), generator=gen), lengths)
    return case, lengths, targets


def make_inputs(name: str, seed: int, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    case, lengths, targets = case_lengths(name, gen)
    return inputs_of(case, lengths, targets, seed, device)


def inputs_of(case: Case, lengths: torch.Tensor, targets: torch.Tensor, seed: int, device: torch.device) -> dict[str, Any]:
    """q, k, v (silu of N(0, 1) draws, bf16) for these lengths, and the call's options."""
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    rows = int(offsets[-1])
    device_gen = torch.Generator(device).manual_seed(seed)

    def draw() -> torch.Tensor:
        return F.silu(torch.randn(rows, case.heads, case.dim, generator=device_gen, device=device)).to(torch.bfloat16)

    q, k, v, grad_out = draw(), draw(), draw(), draw()
    has_targets = bool(targets.any())
    return dict(case=case, q=q, k=k, v=v, grad_out=grad_out, offsets=offsets.to(device), lengths=lengths,
                targets=targets.to(device) if has_targets else None, squares=int((lengths.double() ** 2).sum()),
                options=dict(max_seq_len=case.max_seq_len, alpha=case.dim ** -0.5, max_attn_len=0))  # fmt: skip


def triton_forward(x: dict[str, Any], out: torch.Tensor | None = None) -> torch.Tensor:
    return query_major(x["q"], x["k"], x["v"], None, x["offsets"], x["targets"], out=out, **x["options"])


def triton_dq(x: dict[str, Any], out: torch.Tensor | None = None) -> torch.Tensor:
    return query_major(x["q"], x["k"], x["v"], x["grad_out"], x["offsets"], x["targets"], out=out, **x["options"])


def gluon_dq(x: dict[str, Any], config: str, out: torch.Tensor | None = None) -> torch.Tensor:
    o = x["options"]
    return attention_gluon.dq(x["q"], x["k"], x["v"], x["grad_out"], x["offsets"], x["targets"], out=out,
                              config=config, max_seq_len=o["max_seq_len"], alpha=o["alpha"])  # fmt: skip


def gluon_forward(x: dict[str, Any], config: str, out: torch.Tensor | None = None) -> torch.Tensor:
    o = x["options"]
    return attention_gluon.forward(x["q"], x["k"], x["v"], x["offsets"], x["targets"], out=out, config=config,
                                   max_seq_len=o["max_seq_len"], alpha=o["alpha"])  # fmt: skip


def reference_errors(x: dict[str, Any], outputs: dict[str, torch.Tensor], dq: bool = False) -> dict[str, float]:
    """Each output's relative error against float64 on the first sequences (up to ``REFERENCE_ROWS`` rows):
    against the attention output, or with ``dq`` against the gradient of ``q``."""
    offsets = x["offsets"].cpu()
    seqs = max(1, int((offsets[1:] <= REFERENCE_ROWS).sum()))
    rows = int(offsets[seqs])
    if rows == 0:
        return {name: 0.0 for name in outputs}
    targets = None if x["targets"] is None else x["targets"][:seqs]
    o = x["options"]
    leaves = [x[n][:rows].double().requires_grad_(dq) for n in ("q", "k", "v")]
    exact = jagged_attention_reference(
        *leaves, x["offsets"][: seqs + 1],
        max_seq_len=o["max_seq_len"], alpha=o["alpha"], extras=AttentionExtras(num_targets=targets),
    )
    if dq:
        exact = torch.autograd.grad(exact, leaves[0], x["grad_out"][:rows].double())[0]
    return {name: relative_error(out[:rows].double(), exact) for name, out in outputs.items()}


def check(x: dict[str, Any], configs: list[str], max_error: float,
          forward: Callable[[dict[str, Any], str, torch.Tensor], torch.Tensor] = gluon_forward,
          dq: bool = False) -> dict[str, Any]:
    """Every config's output against the Triton kernel's and against float64 (with ``dq``: ``forward`` is
    a ``dq`` pass, checked against the Triton one and the float64 gradient); ``failures`` lists what failed."""
    base = triton_dq(x) if dq else triton_forward(x)
    outputs = {"triton": base}
    for config in configs:
        out = torch.full_like(base, float("nan"))
        forward(x, config, out)
        outputs[config] = out
    exact = reference_errors(x, outputs, dq)
    result: dict[str, Any] = {"against_triton": {}, "against_float64": exact, "failures": []}
    for config in configs:
        err = relative_error(outputs[config].double(), base.double()) if base.numel() else 0.0
        result["against_triton"][config] = err
        if not err <= max_error:  # NaN fails
            result["failures"].append(f"{config}: {err:.3g} from the Triton output (limit {max_error})")
        if not exact[config] <= 2 * exact["triton"] + 1e-3:
            result["failures"].append(f"{config}: {exact[config]:.3g} from float64, Triton {exact['triton']:.3g}")
    return result


def run_case(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    x = make_inputs(name, args.seed, device)
    case = x["case"]
    row: dict[str, Any] = {"case": name, "rows": int(x["offsets"][-1]), "batch": len(x["lengths"]), "heads": case.heads,
                           "dim": case.dim, "seed": args.seed}  # fmt: skip
    row["check"] = check(x, args.configs, args.max_error)
    dq_configs = [c for c in args.dq_configs if c]
    if dq_configs:
        row["dq_check"] = check(x, dq_configs, args.max_error, forward=gluon_dq, dq=True)
    if row["check"]["failures"] or row.get("dq_check", {}).get("failures") or name == "edges":
        return row  # edges: a correctness case, not a speed one
    work = flops(case, x["squares"])[0]
    fns: dict[str, Callable[[], object]] = {"triton": lambda: triton_forward(x)}
    for config in args.configs:
        fns[config] = lambda c=config: gluon_forward(x, c)
    times = rotated_rounds(fns, args.rounds)
    row["forward"] = {n: {**spread(ms), "tflops": work / spread(ms)["median"] / 1e9} for n, ms in times.items()}
    if dq_configs:  # the dq pass: three MMAs of the forward's size a step, 1.5x its FLOPs
        fns = {"triton": lambda: triton_dq(x)} | {c: (lambda c=c: gluon_dq(x, c)) for c in dq_configs}
        times = rotated_rounds(fns, args.rounds)
        row["dq"] = {n: {**spread(ms), "tflops": 1.5 * work / spread(ms)["median"] / 1e9} for n, ms in times.items()}
    return row


def print_table(rows: list[dict[str, Any]], which: str = "forward") -> None:
    print(f"| case | kernel | {which} ms (q1-q3) | TFLOP/s | against Triton | error vs Triton | vs float64 |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        c = row["check" if which == "forward" else "dq_check"]
        timed = row.get(which, {})
        base = timed.get("triton", {}).get("median")
        for name in ["triton", *c["against_triton"]]:
            t = timed.get(name)
            speed = f"{base / t['median']:.3f}x" if t and base else "-"
            vs_triton = "-" if name == "triton" else f"{c['against_triton'][name]:.2e}"
            print(f"| {row['case']} | {name} | {cell(t) if t else '-'} | {t['tflops']:.0f} |" if t else
                  f"| {row['case']} | {name} | - | - |", end="")  # fmt: skip
            print(f" {speed} | {vs_triton} | {c['against_float64'][name]:.2e} |")
        for failure in c["failures"]:
            print(f"FAILED {row['case']}: {failure}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--configs", default=",".join(attention_gluon.CONFIGS))
    parser.add_argument("--dq-configs", default=",".join(attention_gluon.DQ_CONFIGS),
                        help="the dq pass's configs to check and time ('' for none)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-error", type=float, default=1e-2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    args.configs = [c for c in args.configs.split(",") if c]
    args.dq_configs = [c for c in args.dq_configs.split(",") if c]
    unknown = [c for c in args.cases if c != "edges" and c not in CASES] + [
        c for c in args.configs if c not in attention_gluon.CONFIGS] + [
        c for c in args.dq_configs if c not in attention_gluon.DQ_CONFIGS]
    if unknown:
        parser.error(f"unknown case or config: {', '.join(unknown)} (cases: edges, {', '.join(CASES)}; "
                     f"configs: {', '.join(attention_gluon.CONFIGS)})")  # fmt: skip
    if args.seed is None:
        args.seed = int(time.time()) % 100_000
    print(f"seed {args.seed}")
    device = torch.device("cuda")
    q = torch.zeros(1, 1, 128, dtype=torch.bfloat16, device=device)
    if not attention_gluon.supported(q, q, q):
        print(f"the Gluon forward does not run here ({torch.cuda.get_device_name()}): it needs sm_90")
        return 1
    rows = []
    for name in args.cases:
        rows.append(run_case(name, args, device))
        save_results(args.out, rows, seed=args.seed)
    print_table(rows)
    if args.dq_configs:
        print_table(rows, "dq")
    return 1 if any(r["check"]["failures"] or r.get("dq_check", {}).get("failures") for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
