"""Jagged HSTU attention on one GPU: the Triton kernels against the pure-torch reference and SDPA.

Protocol (seed 1001 per case): B=512, H=4, Dqk=Dv=128, N in {256, 1024, 4096}; sequence lengths
uniform integers in [(2s-1)N, N) for sparsity s >= 0.5, in [0, 2sN) below, s in {0.95, 0.3};
num_targets uniform in 1..20 clipped to the length; alpha = 1/Dqk; q, k, v uniform in (-0.01, 0.01),
bf16. Plus a MovieLens-like case: B=128, H=2, D=64, N=200, s=0.6.

FLOPs count the causal half of every sequence: forward 2 H (Dqk + Dv) S / 2, backward
2 H (3 Dqk + 2 Dv) S / 2, with S the sum of squared lengths. Times are medians of
``triton.testing.do_bench``. Before timing, each case checks the Triton output and gradients against
the float64 reference on its first sequences, and that the full batch reproduces them.

The kernels tune themselves per (dtype, head dims, mask kind, max_seq_len bucket, mean length
bucket) on their first call; the record keeps, per case and dq mode, the config each kernel ran
(``configs``), and for every tuning key all candidates' median ms (``autotuned_configs``).

    PYTHONPATH=packages/gem-model/src:packages/gem-kernels/src \\
        python benchmarks/jagged_attention.py --out results/jagged_attention.json [--quick] [--cases a,b]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from gem_kernels import attention_stored
from gem_kernels.attention_triton_autograd import (
    autotuned_configs,
    clear_last_configs,
    jagged_attention_triton,
    last_configs,
    resolve_dq_mode,
)
from gem_kernels.reference import jagged_attention_reference
from gem_kernels.testing import attention_errors
from gem_model.api import AttentionExtras

SEED = 1001
REP_MS = 300  # do_bench's budget per measurement: a few repetitions even of the 80 ms cases
DQ_MODES = ("atomic", "separate", "stored")
"""The backward's ``dq`` variants: fp32 atomics in the ``dk``/``dv`` pass, a separate query-major pass that
recomputes the scores, or a pass over the score gradients the ``dk``/``dv`` pass stored (a group of heads at
a time when all heads' tiles pass ``attention_stored.BUDGET_BYTES``: see ``stored_heads``; it recomputes, as
``separate``, when not even one head's fit)."""


@dataclass(frozen=True)
class Case:
    batch: int
    heads: int
    dim: int
    max_seq_len: int
    sparsity: float
    fwd_target: float | None = None  # TFLOP/s
    bwd_target: float | None = None
    fwd_ms_limit: float | None = None
    lengths: str = "uniform"
    """``uniform`` (the sparsity rule above), ``fixed`` (every sequence ``max_seq_len`` long, no targets:
    NVIDIA's uniform-length protocol) or ``powerlaw`` (P(n) ~ (n + 1)^-0.95 over 0..N-1, one target
    each: the lengths of configs/h200-large.yaml's synthetic source, as the model sees them)."""


CASES = {
    "n256_s0.95": Case(512, 4, 128, 256, 0.95),
    "n256_s0.3": Case(512, 4, 128, 256, 0.3),
    "n1024_s0.95": Case(512, 4, 128, 1024, 0.95, fwd_target=320, bwd_target=205),
    "n1024_s0.3": Case(512, 4, 128, 1024, 0.3, fwd_target=220, bwd_target=160),
    "n4096_s0.95": Case(512, 4, 128, 4096, 0.95, fwd_target=390, bwd_target=235),
    "n4096_s0.3": Case(512, 4, 128, 4096, 0.3),
    "movielens": Case(128, 2, 64, 200, 0.6, fwd_ms_limit=0.1),
    "fixed1024": Case(512, 4, 128, 1024, 1.0, fwd_target=392, bwd_target=309, lengths="fixed"),
    "fixed2048": Case(512, 4, 128, 2048, 1.0, fwd_target=466, bwd_target=386, lengths="fixed"),
    "fixed4096": Case(512, 4, 128, 4096, 1.0, fwd_target=508, bwd_target=433, lengths="fixed"),
    "big_config": Case(384, 8, 128, 4096, 0.95, lengths="powerlaw"),
}
QUICK_CASES = ("n1024_s0.95", "n4096_s0.95", "n1024_s0.3", "movielens")


def sample_lengths(case: Case, gen: torch.Generator) -> torch.Tensor:
    n, s = case.max_seq_len, case.sparsity
    if case.lengths == "fixed":
        return torch.full((case.batch,), n, dtype=torch.int64)
    if case.lengths == "powerlaw":  # the history (0..N-2 long) plus the candidate
        weights = (torch.arange(n - 1, dtype=torch.float64) + 1) ** -0.95
        return torch.multinomial(weights, case.batch, replacement=True, generator=gen) + 1
    low, high = (math.ceil(round((2 * s - 1) * n, 6)), n) if s >= 0.5 else (0, math.ceil(round(2 * s * n, 6)))
    return torch.randint(low, high, (case.batch,), generator=gen)


def make_inputs(case: Case, device: torch.device, seed: int = SEED) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    lengths = sample_lengths(case, gen)
    targets = torch.minimum(torch.randint(1, 21, (case.batch,), generator=gen), lengths)
    if case.lengths == "fixed":
        targets = torch.zeros_like(lengths)
    elif case.lengths == "powerlaw":
        targets = torch.ones_like(lengths)
    offsets = torch.zeros(case.batch + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    rows = int(offsets[-1])
    device_gen = torch.Generator(device).manual_seed(seed)  # the values are drawn where they live: GBs of them

    def draw() -> torch.Tensor:
        x = torch.rand(rows, case.heads, case.dim, generator=device_gen, device=device)
        return (x * 0.02 - 0.01).to(torch.bfloat16)

    q, k, v, grad_out = draw(), draw(), draw(), draw()
    return dict(
        q=q, k=k, v=v, grad_out=grad_out, offsets=offsets.to(device), targets=targets.to(device),
        lengths=lengths, squares=int((lengths.double() ** 2).sum()),
    )


def flops(case: Case, squares: int) -> tuple[float, float]:
    d = case.dim
    return 2 * case.heads * 2 * d * squares / 2, 2 * case.heads * 5 * d * squares / 2


def tflops(work: float, ms: float | None) -> float | None:
    return None if ms is None else work / ms / 1e9


def time_fwd_bwd(forward: Callable[..., torch.Tensor], inputs: dict[str, Any]) -> tuple[float, float]:
    """Median ms of the forward alone (no autograd) and of the backward of one recorded forward."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    fwd = do_bench(lambda: forward(q, k, v), rep=REP_MS, return_mode="median")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = forward(*leaves)
    bwd = do_bench(
        lambda: torch.autograd.grad(out, leaves, inputs["grad_out"], retain_graph=True), rep=REP_MS,
        return_mode="median",
    )
    return fwd, bwd


def run_once(forward: Callable[..., torch.Tensor], inputs: dict[str, Any]) -> None:
    leaves = [inputs[n].detach().requires_grad_() for n in ("q", "k", "v")]
    torch.autograd.grad(forward(*leaves), leaves, inputs["grad_out"])
    torch.cuda.synchronize()


def check(case: Case, inputs: dict[str, Any], mode: str) -> dict[str, float]:
    """Relative errors on the first sequences (the float64 reference must fit in memory), and the
    largest difference between the full batch's output and the subset's (same sequences)."""
    per_seq = 10 * case.heads * case.max_seq_len**2 * 8  # float64 score-sized tensors the reference keeps
    count = max(1, min(case.batch, 64, int(16e9 // per_seq)))
    rows = int(inputs["offsets"][count])
    sub = {name: inputs[name][:rows] for name in ("q", "k", "v", "grad_out")}
    options = dict(max_seq_len=case.max_seq_len, alpha=1.0 / case.dim)
    kernel = functools.partial(jagged_attention_triton, dq_mode=mode)
    errors = attention_errors(
        kernel, sub["q"], sub["k"], sub["v"], inputs["offsets"][: count + 1], sub["grad_out"],
        num_targets=inputs["targets"][:count], **options,
    )
    with torch.no_grad():
        full = kernel(
            inputs["q"], inputs["k"], inputs["v"], inputs["offsets"],
            extras=AttentionExtras(num_targets=inputs["targets"]), **options,
        )
        part = kernel(sub["q"], sub["k"], sub["v"], inputs["offsets"][: count + 1],
                      extras=AttentionExtras(num_targets=inputs["targets"][:count]), **options)
        errors["full_vs_subset_max_abs"] = (full[:rows].float() - part.float()).abs().max().item()
        errors["full_finite"] = float(torch.isfinite(full).all().item())
    errors["checked_sequences"] = count
    return errors


def padded(x: torch.Tensor, lengths: torch.Tensor, size: int) -> torch.Tensor:
    seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=x.device), lengths.to(x.device))
    starts = torch.cumsum(lengths, 0).to(x.device) - lengths.to(x.device)
    pos = torch.arange(x.shape[0], device=x.device) - starts[seq]
    out = x.new_zeros(lengths.numel(), size, *x.shape[1:]).index_put((seq, pos), x)
    return out.transpose(1, 2).contiguous()  # [B, H, N, D]


def run_case(name: str, case: Case, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    row: dict[str, Any] = {"case": name, **asdict(case), "errors": {}, "failures": {}, "configs": {}}
    started = time.perf_counter()

    def stage(label: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # one failing stage is reported; the rest of the run goes on
            traceback.print_exc()
            row["failures"][label] = f"{type(exc).__name__}: {exc}"[:500]
            torch.cuda.empty_cache()
            return None

    inputs = stage("inputs", lambda: make_inputs(case, device, args.seed))
    if inputs is None:
        return row
    fwd_flops, bwd_flops = flops(case, inputs["squares"])
    row.update(rows=int(inputs["offsets"][-1]), squares=inputs["squares"], fwd_flops=fwd_flops, bwd_flops=bwd_flops)
    row["dq_auto"] = resolve_dq_mode("auto", row["rows"], case.batch, case.heads)
    plan = attention_stored.prepare(inputs["offsets"], case.heads)
    row["stored_bytes"] = plan.buffer_bytes(inputs["q"].dtype)  # every head's tiles
    row["stored_heads"] = plan.group_heads(inputs["q"].dtype)  # heads a buffer holds (0: bwd3 recomputes)
    options = dict(max_seq_len=case.max_seq_len, alpha=1.0 / case.dim,
                   extras=AttentionExtras(num_targets=inputs["targets"]))
    offsets = inputs["offsets"]
    for mode in args.dq_modes:

        def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mode: str = mode) -> torch.Tensor:
            return jagged_attention_triton(q, k, v, offsets, dq_mode=mode, **options)

        # Autotune on the full batch first: the check's few sequences would tune for the wrong shape.
        clear_last_configs()
        stage(f"warmup_{mode}", lambda f=triton_attention: run_once(f, inputs))
        row["configs"][mode] = last_configs()  # what each kernel ran on the full batch (tuned just now)
        row["errors"][mode] = stage(f"check_{mode}", lambda mode=mode: check(case, inputs, mode))
        timed = stage(f"triton_{mode}", lambda f=triton_attention: time_fwd_bwd(f, inputs))
        if timed is not None:
            row.setdefault("triton_fwd_ms", timed[0])
            row[f"triton_bwd_{mode}_ms"] = timed[1]
    size = int(inputs["lengths"].max())
    reference_bytes = 12 * case.batch * case.heads * size**2 * 4
    free = torch.cuda.mem_get_info(device)[0]
    if args.quick or reference_bytes > 0.6 * free:
        row["reference_skipped"] = (
            "--quick" if args.quick else f"needs ~{reference_bytes / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free"
        )
    else:
        ref = stage(
            "reference",
            lambda: time_fwd_bwd(lambda q, k, v: jagged_attention_reference(q, k, v, offsets, **options), inputs),
        )
        if ref is not None:
            row["reference_fwd_ms"], row["reference_bwd_ms"] = ref
    if not args.quick:

        def sdpa() -> tuple[float, float]:
            dense = {n: padded(inputs[n], inputs["lengths"], case.max_seq_len) for n in ("q", "k", "v", "grad_out")}
            return time_fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), dense)

        sd = stage("sdpa", sdpa)
        if sd is not None:
            row["sdpa_padded_fwd_ms"], row["sdpa_padded_bwd_ms"] = sd
    inputs.clear()  # frees this case's tensors before the next case allocates
    torch.cuda.empty_cache()
    row["elapsed_s"] = round(time.perf_counter() - started, 1)
    return row


def verdict(row: dict[str, Any]) -> str:
    notes = []
    fwd = tflops(row.get("fwd_flops", 0), row.get("triton_fwd_ms"))
    bwds = [tflops(row.get("bwd_flops", 0), row.get(f"triton_bwd_{m}_ms")) for m in DQ_MODES]
    bwd = max((b for b in bwds if b is not None), default=None)
    if row.get("fwd_target") and fwd is not None:
        notes.append(f"fwd {'ok' if fwd >= row['fwd_target'] else 'MISS'} (>= {row['fwd_target']})")
    if row.get("bwd_target") and bwd is not None:
        notes.append(f"bwd {'ok' if bwd >= row['bwd_target'] else 'MISS'} (>= {row['bwd_target']})")
    if row.get("fwd_ms_limit") and row.get("triton_fwd_ms") is not None:
        ok = row["triton_fwd_ms"] < row["fwd_ms_limit"]
        notes.append(f"fwd {'ok' if ok else 'MISS'} (< {row['fwd_ms_limit']} ms)")
    return ", ".join(notes)


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'case':<12} {'rows':>8} {'fwd ms':>8} {'TF/s':>6} {'bwd ms':>8} {'TF/s':>6} {'bwd2 ms':>8} "
              f"{'TF/s':>6} {'bwd3 ms':>8} {'TF/s':>6} {'heads':>6} {'ref f/b ms':>15} {'sdpa f/b ms':>15} {'max rel err':>11}  verdict / failures")
    print(header)
    print("-" * len(header))
    for row in rows:
        checked = [errors for errors in row["errors"].values() if errors]
        errs = [errors[name] for errors in checked for name in ("out", "dq", "dk", "dv")]
        ref = f"{fmt(row.get('reference_fwd_ms'), '.2f')}/{fmt(row.get('reference_bwd_ms'), '.2f')}"
        sdpa = f"{fmt(row.get('sdpa_padded_fwd_ms'), '.2f')}/{fmt(row.get('sdpa_padded_bwd_ms'), '.2f')}"
        notes = [verdict(row)] if verdict(row) else []
        if row.get("reference_skipped"):
            notes.append(f"reference skipped: {row['reference_skipped']}")
        if row["failures"]:
            notes.append("FAILED " + "; ".join(f"{k}: {v[:120]}" for k, v in row["failures"].items()))
        tail = "; ".join(notes)
        print(
            f"{row['case']:<12} {row.get('rows', 0):>8} {fmt(row.get('triton_fwd_ms')):>8} "
            f"{fmt(tflops(row.get('fwd_flops', 0), row.get('triton_fwd_ms')), '.0f'):>6} "
            f"{fmt(row.get('triton_bwd_atomic_ms')):>8} "
            f"{fmt(tflops(row.get('bwd_flops', 0), row.get('triton_bwd_atomic_ms')), '.0f'):>6} "
            f"{fmt(row.get('triton_bwd_separate_ms')):>8} "
            f"{fmt(tflops(row.get('bwd_flops', 0), row.get('triton_bwd_separate_ms')), '.0f'):>6} "
            f"{fmt(row.get('triton_bwd_stored_ms')):>8} "
            f"{fmt(tflops(row.get('bwd_flops', 0), row.get('triton_bwd_stored_ms')), '.0f'):>6} "
            f"{row.get('stored_heads', 0):>6} "
            f"{ref:>15} {sdpa:>15} {fmt(max(errs) if errs else None, '.1e'):>11}  {tail}"
        )
    print("bwd = dq by fp32 atomics in the dk/dv pass; bwd2 = dq by a separate query-major pass; bwd3 = dq from "
          "the score gradients the dk/dv pass stored (heads: how many heads' tiles a buffer holds within "
          "attention_stored.BUDGET_BYTES, the passes taking that many at a time; 0: bwd3 recomputes as bwd2). TF/s count real (causal, jagged) FLOPs for every column.")


def print_configs(rows: list[dict[str, Any]]) -> None:
    """Per case: the dq mode ``auto`` picks, its elapsed time, and the config each kernel ran."""
    print()
    print("configs run on the full batch (chosen by tuning on it) and dq_mode=auto's pick:")
    for row in rows:
        print(f"{row['case']:<12} auto dq -> {row.get('dq_auto', '-')}, {row.get('elapsed_s', '-')} s")
        seen: set[tuple[str, str]] = set()
        for configs in row.get("configs", {}).values():
            for kernel, config in configs.items():
                if (kernel, config) not in seen:
                    seen.add((kernel, config))
                    print(f"    {kernel:<12} {config}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="the target cases only; skip the reference and SDPA")
    parser.add_argument("--seed", type=int, default=SEED, help="the lengths' and values' seed")
    parser.add_argument("--cases", help=f"comma-separated subset of: {', '.join(CASES)}")
    parser.add_argument(
        "--dq", default="all", help=f"backward variants to check and time: all, or some of {', '.join(DQ_MODES)}, comma-separated"
    )
    args = parser.parse_args(argv)
    modes = DQ_MODES if args.dq == "all" else tuple(args.dq.split(","))
    if not modes or any(m not in DQ_MODES for m in modes):
        parser.error(f"--dq {args.dq}: choose all, or some of {', '.join(DQ_MODES)}")
    args.dq_modes = modes
    if not torch.cuda.is_available():
        print("jagged_attention benchmark: needs a CUDA device", file=sys.stderr)
        return 2
    names = args.cases.split(",") if args.cases else list(QUICK_CASES if args.quick else CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; choose from {list(CASES)}")
    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []

    def write_record() -> None:
        record = {
            "benchmark": "jagged_attention",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join([sys.executable, *sys.argv]),
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "seed": args.seed,
            "autotuned_configs": autotuned_configs(),
            "cases": rows,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2, default=str)

    for name in names:
        print(f"== {name}", file=sys.stderr, flush=True)
        rows.append(run_case(name, CASES[name], args, device))
        print(f"== {name}: {rows[-1].get('elapsed_s')} s; {verdict(rows[-1])}", file=sys.stderr, flush=True)
        if args.out:
            write_record()  # after every case: a run cut short still leaves the cases it finished
    print_table(rows)
    print_configs(rows)
    if args.out:
        write_record()
        print(f"wrote {args.out}")
    return 1 if any(row["failures"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
