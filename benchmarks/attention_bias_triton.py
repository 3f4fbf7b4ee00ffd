"""HSTU's relative attention biases in the Triton ``jagged_attention`` kernel: a self-check, then times.

Per case (bf16 q, k, v; B sequences of power-law lengths up to N, 1-8 targets each; H heads of D dims;
rating-like timestamps: bursts seconds apart, gaps of hours to months; fp32 tables, 128 time buckets):

1. check, on fresh random data (seed printed, ``--seed`` replays it):
   * the Triton kernel with both biases against the torch kernel run in float64, on the case's first
     sequences (as many as the float64 torch kernel fits): relative errors of the output and of the
     gradients of q, k, v, ``position_bias`` and ``time_bias``;
   * on the whole batch: every output finite, the first sequences' rows equal to the subset run's
     (up to the order of dq's atomics),
     and the bias gradients equal to the sum of those of four disjoint quarters of the batch (the
     striped atomics at full size, against themselves);
   * the kernels' time buckets against ``gem_model.jagged.time_buckets`` on 2^20 of the case's (query,
     key) time differences and on both sides of every bucket edge (must be 0 mismatches).
2. time: forward (no autograd) and backward (of one recorded forward) ms, median of
   ``triton.testing.do_bench``, without a bias, with the position bias, the time bias, and both; the
   torch kernel with both biases where its padded buckets fit in memory.

    python benchmarks/attention_bias_triton.py --out /tmp/attention_bias_triton.json
    TRITON_INTERPRET=1 python benchmarks/attention_bias_triton.py --device cpu --out /tmp/smoke.json  # tiny

``--device cpu`` runs one tiny case under Triton's interpreter (a smoke test of this script, no timing
worth reading). Exit status 1 when a check fails. Needs torch, triton and pluggy only (not pydantic):
``PYTHONPATH=$(ls -d packages/*/src | paste -sd:)`` on the GPU machine.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import platform
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton

from gem_kernels.attention_torch import jagged_attention_torch
from gem_kernels.attention_triton_autograd import (
    autotuned_configs,
    clear_last_configs,
    jagged_attention_triton,
    last_configs,
)
from gem_kernels.attention_triton_bias import bucket_edges, time_buckets_triton
from gem_kernels.testing import relative_error
from gem_model.api import AttentionExtras
from gem_model.jagged import time_buckets

NUM_BUCKETS = 128
TOLERANCE = 2e-2  # relative Frobenius error of bf16 inputs against float64
VARIANTS = {"none": (), "position": ("position",), "time": ("time",), "both": ("position", "time")}


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    dim: int
    max_seq_len: int


CASES = {
    "b128_h2_d64_n1024": Case(128, 2, 64, 1024),
    "b512_h4_d128_n1024": Case(512, 4, 128, 1024),
    "b256_h8_d64_n2048": Case(256, 8, 64, 2048),
    "b128_h4_d128_n4096": Case(128, 4, 128, 4096),
}
CPU_CASES = {"cpu_tiny": Case(4, 2, 16, 48)}


def make_inputs(case: Case, device: torch.device, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    n = case.max_seq_len
    # Pareto lengths (tail index 1, scale N / 16), cut at N: median N / 8, ~6 % at N
    u = torch.rand(case.batch, generator=gen).clamp(min=1e-6)
    lengths = torch.clamp((n / 16 / u).long(), 1, n)
    targets = torch.minimum(torch.randint(1, 9, (case.batch,), generator=gen), lengths)
    offsets = torch.zeros(case.batch + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    rows = int(offsets[-1])
    gaps = torch.where(torch.rand(rows, generator=gen) < 0.15, torch.randint(10**4, 10**7, (rows,), generator=gen),
                       torch.randint(0, 120, (rows,), generator=gen))
    times = 1_700_000_000 + torch.cumsum(gaps, 0)
    query_times = torch.cat([times[1:], times[-1:] + 60])  # each query asked at the next row's time

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    return dict(
        q=draw(rows, case.heads, case.dim).to(torch.bfloat16), k=draw(rows, case.heads, case.dim).to(torch.bfloat16),
        v=draw(rows, case.heads, case.dim).to(torch.bfloat16), grad_out=draw(rows, case.heads, case.dim).to(torch.bfloat16),
        offsets=offsets.to(device), targets=targets.to(device), lengths=lengths,
        position_bias=draw(2 * n - 1, scale=0.3), time_bias=draw(NUM_BUCKETS, scale=0.3),
        timestamps=times.to(device), query_timestamps=query_times.to(device),
    )


def call_kwargs(inputs: dict[str, Any], biases: tuple[str, ...], tables: dict[str, torch.Tensor] | None = None,
                count: int | None = None) -> dict[str, Any]:
    """Keyword arguments of one call (the first ``count`` sequences when given)."""
    rows = None if count is None else int(inputs["offsets"][count])
    kw: dict[str, Any] = {"num_targets": inputs["targets"][:count] if count is not None else inputs["targets"]}
    tables = tables if tables is not None else {}
    if "position" in biases:
        kw["position_bias"] = tables.get("position_bias", inputs["position_bias"])
    if "time" in biases:
        kw["time_bias"] = tables.get("time_bias", inputs["time_bias"])
        kw["timestamps"] = inputs["timestamps"][:rows]
        kw["query_timestamps"] = inputs["query_timestamps"][:rows]
    return kw


def run(kernel: Callable[..., torch.Tensor], case: Case, inputs: dict[str, Any], biases: tuple[str, ...],
        count: int | None = None, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """Output and gradients (q, k, v, then each table) of the first ``count`` sequences (all: None)."""
    rows = None if count is None else int(inputs["offsets"][count])
    offsets = inputs["offsets"] if count is None else inputs["offsets"][: count + 1]
    leaves = [inputs[n][:rows].detach().to(dtype or inputs[n].dtype).requires_grad_() for n in ("q", "k", "v")]
    tables = {n: inputs[n].detach().to(dtype or inputs[n].dtype).requires_grad_()
              for n, b in (("position_bias", "position"), ("time_bias", "time")) if b in biases}
    out = kernel(*leaves, offsets, max_seq_len=case.max_seq_len, alpha=1.0 / case.dim,
                 extras=AttentionExtras(**call_kwargs(inputs, biases, tables, count)))
    grads = torch.autograd.grad(out, [*leaves, *tables.values()], inputs["grad_out"][:rows].to(out.dtype))
    return [out.detach(), *grads]


def check(case: Case, inputs: dict[str, Any], device: torch.device,
          triton_kernel: Callable[..., torch.Tensor]) -> dict[str, Any]:
    both = VARIANTS["both"]
    per_seq = 12 * case.heads * case.max_seq_len**2 * 8  # float64 score-sized tensors the torch kernel keeps
    budget = 8e9 if device.type == "cuda" else 1e9
    count = max(1, min(case.batch, 64, int(budget // per_seq)))
    names = ["out", "dq", "dk", "dv", "dposition_bias", "dtime_bias"]
    got = run(triton_kernel, case, inputs, both, count)
    want = run(jagged_attention_torch, case, inputs, both, count, dtype=torch.float64)
    result: dict[str, Any] = {"checked_sequences": count, "checked_rows": int(inputs["offsets"][count])}
    result.update({name: relative_error(g, w) for name, g, w in zip(names, got, want, strict=True)})
    del want
    full = run(triton_kernel, case, inputs, both)
    rows = result["checked_rows"]
    result["full_finite"] = all(bool(torch.isfinite(t).all()) for t in full)
    result["full_vs_subset"] = max(relative_error(f[:rows], g) for f, g in zip(full[:4], got[:4], strict=True))
    quarters = torch.linspace(0, case.batch, 5).long().tolist()
    summed = [torch.zeros_like(t, dtype=torch.float64) for t in full[4:]]
    for lo, hi in itertools.pairwise(quarters):
        if hi == lo:
            continue
        start, end = int(inputs["offsets"][lo]), int(inputs["offsets"][hi])
        part = {**inputs, "offsets": inputs["offsets"][lo: hi + 1] - start, "targets": inputs["targets"][lo:hi]}
        for name in ("q", "k", "v", "grad_out", "timestamps", "query_timestamps"):
            part[name] = inputs[name][start:end]
        for total, grad in zip(summed, run(triton_kernel, case, part, both)[4:], strict=True):
            total += grad.double()
    result["bias_grads_full_vs_quarters"] = max(relative_error(f, s) for f, s in zip(full[4:], summed, strict=True))
    # time buckets: the case's own differences, and both sides of every edge
    gen = torch.Generator().manual_seed(0)
    pick = torch.randint(0, int(inputs["offsets"][-1]), (2, 2**20), generator=gen).to(device)
    dt = inputs["query_timestamps"][pick[0]] - inputs["timestamps"][pick[1]]
    edges = bucket_edges(NUM_BUCKETS, device).clamp(max=2**62)
    dt = torch.cat([dt, *(s * (edges + d) for s in (1, -1) for d in (-1, 0, 1))])
    got_buckets, want_buckets = time_buckets_triton(dt, NUM_BUCKETS).long(), time_buckets(dt, NUM_BUCKETS)
    wrong = got_buckets != want_buckets
    result["bucket_mismatches"] = int(wrong.sum())
    result["bucket_mismatch_examples"] = [  # (dt, kernel's bucket, torch's) of the first few
        list(t) for t in zip(dt[wrong][:8].tolist(), got_buckets[wrong][:8].tolist(), want_buckets[wrong][:8].tolist(),
                             strict=True)]
    result["passed"] = (all(result[n] < TOLERANCE for n in names) and result["full_finite"]
                        and result["bias_grads_full_vs_quarters"] < 1e-4 and result["bucket_mismatches"] == 0
                        and result["full_vs_subset"] < TOLERANCE)
    return result


def bench(fn: Callable[[], Any], device: torch.device, iters: int) -> float:
    if device.type == "cuda":
        return float(triton.testing.do_bench(fn, rep=200, return_mode="median"))
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e3


def time_variant(kernel: Callable[..., torch.Tensor], case: Case, inputs: dict[str, Any], biases: tuple[str, ...],
                 device: torch.device, iters: int) -> tuple[float, float]:
    """Forward ms without autograd and backward ms of one recorded forward (tables requiring grad)."""
    options = dict(max_seq_len=case.max_seq_len, alpha=1.0 / case.dim)
    run(kernel, case, inputs, biases)  # tunes the Triton kernels on this variant first
    with torch.no_grad():
        fwd = bench(lambda: kernel(inputs["q"], inputs["k"], inputs["v"], inputs["offsets"], **options,
                                   extras=AttentionExtras(**call_kwargs(inputs, biases))), device, iters)
    leaves = [inputs[n].detach().requires_grad_() for n in ("q", "k", "v")]
    tables = {n: inputs[n].detach().requires_grad_()
              for n, b in (("position_bias", "position"), ("time_bias", "time")) if b in biases}
    out = kernel(*leaves, inputs["offsets"], **options, extras=AttentionExtras(**call_kwargs(inputs, biases, tables)))
    targets = [*leaves, *tables.values()]
    bwd = bench(lambda: torch.autograd.grad(out, targets, inputs["grad_out"], retain_graph=True), device, iters)
    return fwd, bwd


def run_case(name: str, case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    inputs = make_inputs(case, device, args.seed)
    lengths = inputs["lengths"].double()
    row: dict[str, Any] = {"case": name, **asdict(case), "rows": int(lengths.sum()),
                           "mean_length": round(float(lengths.mean()), 1), "max_length": int(lengths.max()),
                           "squares": int((lengths**2).sum()), "triton": {}, "configs": {}}
    print(f"== {name}: {row['rows']} rows, mean length {row['mean_length']}", file=sys.stderr, flush=True)
    blocks = tuple(int(b) for b in args.blocks.split(",")) if args.blocks else None
    triton_kernel = functools.partial(jagged_attention_triton, blocks=blocks)
    clear_last_configs()
    row["check"] = check(case, inputs, device, triton_kernel)
    for variant, biases in VARIANTS.items():
        clear_last_configs()
        row["triton"][variant] = time_variant(triton_kernel, case, inputs, biases, device, args.iters)
        row["configs"][variant] = last_configs()
    padded_bytes = 12 * case.heads * row["squares"] * 1.6 * 4  # the torch kernel's padded fp32 buckets, roughly
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 8e9
    if padded_bytes < 0.5 * free:
        row["torch_both"] = time_variant(jagged_attention_torch, case, inputs, VARIANTS["both"], device, args.iters)
    else:
        row["torch_both"] = f"skipped: needs ~{padded_bytes / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
    inputs.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    def ms(pair: Any, i: int) -> str:
        return f"{pair[i]:.3f}" if isinstance(pair, (tuple, list)) else "-"

    print("| case | rows | fwd none / pos / time / both ms | bwd none / pos / time / both ms | torch both fwd / bwd ms "
          "| max rel err | buckets off | check |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        t, c = row["triton"], row["check"]
        fwd = " / ".join(ms(t[v], 0) for v in VARIANTS)
        bwd = " / ".join(ms(t[v], 1) for v in VARIANTS)
        err = max(c[n] for n in ("out", "dq", "dk", "dv", "dposition_bias", "dtime_bias"))
        print(f"| {row['case']} | {row['rows']} | {fwd} | {bwd} | {ms(row['torch_both'], 0)} / {ms(row['torch_both'], 1)} "
              f"| {err:.1e} | {c['bucket_mismatches']} | {'ok' if c['passed'] else 'FAILED'} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--cases", help=f"comma-separated subset of: {', '.join(CASES)}")
    parser.add_argument("--seed", type=int, default=None, help="replay a run's random data (default: fresh)")
    parser.add_argument("--iters", type=int, default=2, help="timing iterations on CPU (CUDA uses do_bench)")
    parser.add_argument("--blocks", help="BLOCK_M,BLOCK_N for every kernel instead of tuning (a quicker check)")
    args = parser.parse_args(argv)
    args.seed = args.seed if args.seed is not None else secrets.randbits(31)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --device cpu (with TRITON_INTERPRET=1) for the smoke test")
    table = CASES if device.type == "cuda" else CPU_CASES
    names = args.cases.split(",") if args.cases else list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(table)}")
    print(f"seed {args.seed}", file=sys.stderr)
    rows = [run_case(name, table[name], args, device) for name in names]
    print_table(rows)
    if args.out:
        record = {
            "benchmark": "attention_bias_triton",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join([sys.executable, *sys.argv]),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "seed": args.seed, "autotuned_configs": autotuned_configs(), "cases": rows,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2, default=str)
    return 0 if all(row["check"]["passed"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
