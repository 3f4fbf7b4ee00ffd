"""The fp8 attention forward (``fp8_forward``, gem_kernels.attention_fp8) against the bf16 one on one GPU.

Cases and inputs are benchmarks/jagged_attention.py's (seed 1001): ``big_config`` (B=384, H=8, D=128,
power-law lengths up to 4096: configs/h200-large.yaml's) and ``fixed1024/2048/4096`` (B=512, H=4, D=128,
every sequence N long). Two input kinds per case: ``uniform`` (that benchmark's q, k, v uniform in
(-0.01, 0.01), alpha = 1/D) and ``silu`` (q, k, v = silu of N(0, 1) draws, as the fused block's silu
pass writes them, alpha = 1/sqrt(D)): the relative error depends on the values' spread, the speed
does not.

First, per case and kind, the numerics: on the first sequences (as many as the float64 reference fits
in memory) the fp8 and bf16 outputs against float64, and on the whole batch the fp8 output against
the bf16 one (the per-layer relative error of fp8 attention), and the fused gap's output ``y`` with fp8
against without. Then the forward is timed (``do_bench`` medians, variants interleaved over
``--rounds`` rounds, the order reversed every other round):

* ``bf16``: ``jagged_attention_triton`` (no grad), the default path;
* ``fp8``: the same with ``fp8_forward=True``: a Triton pass quantizes q and k, then the fp8 kernel;
* ``fp8_kernel``: the fp8 kernel alone on pre-quantized q, k (what the fused gap's attention costs:
  there the silu pass writes the e4m3 copies); ``quantize``: the quantize pass alone;
* ``gap_bf16`` / ``gap_fp8``: the fused gap's forward (silu, attention, norm-gate) without / with it,
  on ``pre`` ~ N(0, 1) (``--no-gap`` skips them).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/attention_fp8.py --out fp8_attention.json
    TRITON_INTERPRET=1 PYTHONPATH=... python benchmarks/attention_fp8.py --smoke   # a tiny case on the CPU

Exit status 1 when a check fails (an output that is not finite, or an fp8 error over ``--max-error``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jagged_attention import CASES, SEED, Case, make_inputs

from gem_kernels.attention_fp8 import quantize_qk
from gem_kernels.attention_triton import query_major
from gem_kernels.attention_triton_autograd import jagged_attention_triton
from gem_kernels.hstu_gap_triton import hstu_gap_triton
from gem_kernels.reference import jagged_attention_reference
from gem_kernels.testing import relative_error
from gem_model.api import AttentionExtras

DEFAULT_CASES = ("big_config", "fixed1024", "fixed2048", "fixed4096")
SMOKE_CASE = Case(3, 2, 32, 48, 0.95, lengths="powerlaw")
KINDS = ("uniform", "silu")
REP_MS = 200


def inputs_of(case: Case, kind: str, device: torch.device) -> dict[str, Any]:
    x = make_inputs(case, device)
    if kind == "silu":
        gen = torch.Generator(device).manual_seed(SEED + 1)
        for name in ("q", "k", "v"):
            x[name] = F.silu(torch.randn(x[name].shape, generator=gen, device=device)).bfloat16()
    x["alpha"] = 1.0 / case.dim if kind == "uniform" else 1.0 / math.sqrt(case.dim)
    return x


def numerics(case: Case, x: dict[str, Any], options: dict[str, Any]) -> dict[str, float]:
    per_seq = 10 * case.heads * case.max_seq_len**2 * 8
    count = max(1, min(case.batch, 64, int(16e9 // per_seq)))
    rows = int(x["offsets"][count])
    sub = [x[n][:rows] for n in ("q", "k", "v")]
    sub_options = {**options, "extras": AttentionExtras(num_targets=x["targets"][:count])}
    offsets = x["offsets"][: count + 1]
    with torch.no_grad():
        want = jagged_attention_reference(*(t.double() for t in sub), offsets, **sub_options)
        got = {fp8: jagged_attention_triton(*sub, offsets, fp8_forward=fp8, **sub_options) for fp8 in (False, True)}
        full = {fp8: jagged_attention_triton(x["q"], x["k"], x["v"], x["offsets"], fp8_forward=fp8, **options)
                for fp8 in (False, True)}  # fmt: skip
    return {
        "checked_sequences": count,
        "bf16_vs_float64": relative_error(got[False], want),
        "fp8_vs_float64": relative_error(got[True], want),
        "fp8_vs_bf16_full_batch": relative_error(full[True], full[False]),
        "fp8_finite": float(torch.isfinite(full[True]).all().item()),
    }


def gap_inputs(case: Case, x: dict[str, Any], device: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device).manual_seed(SEED + 2)
    hv = case.heads * case.dim
    return dict(
        pre=torch.randn(x["q"].shape[0], 4 * hv, generator=gen, device=device).bfloat16(),
        weight=1 + 0.1 * torch.randn(hv, generator=gen, device=device),
        bias=0.1 * torch.randn(hv, generator=gen, device=device),
    )


def gap_forward(case: Case, x: dict[str, Any], g: dict[str, Any], options: dict[str, Any], fp8: bool) -> torch.Tensor:
    with torch.no_grad():
        y, _ = hstu_gap_triton(g["pre"], g["weight"], g["bias"], x["offsets"], num_heads=case.heads,
                               attention_dim=case.dim, value_dim=case.dim, eps=1e-6, fp8_forward=fp8, **options)  # fmt: skip
    return y


def timer(smoke: bool) -> Callable[[Callable[[], Any]], float]:
    if smoke:  # the interpreter: one call, wall time (says only that it runs)

        def once(fn: Callable[[], Any]) -> float:
            started = time.perf_counter()
            fn()
            return (time.perf_counter() - started) * 1e3

        return once
    from triton.testing import do_bench

    return lambda fn: float(do_bench(fn, rep=REP_MS, return_mode="median"))


def run_case(name: str, case: Case, kind: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    x = inputs_of(case, kind, device)
    options = dict(max_seq_len=case.max_seq_len, alpha=x["alpha"], extras=AttentionExtras(num_targets=x["targets"]))
    row: dict[str, Any] = {"case": name, "kind": kind, "rows": int(x["offsets"][-1]), "alpha": x["alpha"]}
    row["errors"] = numerics(case, x, options)
    q, k, v, offsets = x["q"], x["k"], x["v"], x["offsets"]
    q8, k8, scales = quantize_qk(q, k)
    kernel_options = dict(max_seq_len=case.max_seq_len, alpha=x["alpha"], max_attn_len=0)
    variants: dict[str, Callable[[], Any]] = {
        "bf16": lambda: jagged_attention_triton(q, k, v, offsets, **options),
        "fp8": lambda: jagged_attention_triton(q, k, v, offsets, fp8_forward=True, **options),
        "fp8_kernel": lambda: query_major(q8, k8, v, None, offsets, x["targets"], fp8_scales=scales, **kernel_options),
        "quantize": lambda: quantize_qk(q, k),
    }
    if not args.no_gap:
        g = gap_inputs(case, x, device)
        gap_options = dict(max_seq_len=case.max_seq_len, alpha=x["alpha"],
                           extras=AttentionExtras(num_targets=x["targets"]))  # fmt: skip
        y = {fp8: gap_forward(case, x, g, gap_options, fp8) for fp8 in (False, True)}
        row["errors"]["gap_y_fp8_vs_bf16"] = relative_error(y[True], y[False])
        variants["gap_bf16"] = lambda: gap_forward(case, x, g, gap_options, False)
        variants["gap_fp8"] = lambda: gap_forward(case, x, g, gap_options, True)
    time_one = timer(args.smoke)
    with torch.no_grad():
        for fn in variants.values():
            fn()  # tunes and compiles outside the timed rounds
        samples: dict[str, list[float]] = {n: [] for n in variants}
        for r in range(args.rounds):
            for n in list(variants) if r % 2 == 0 else list(reversed(variants)):
                samples[n].append(time_one(variants[n]))
    row["ms"] = {n: sorted(s)[len(s) // 2] for n, s in samples.items()}
    row["ms_rounds"] = samples
    return row


def failed(row: dict[str, Any], max_error: float) -> list[str]:
    errors = row["errors"]
    problems = [] if errors["fp8_finite"] else ["fp8 output not finite"]
    for key in ("fp8_vs_float64", "fp8_vs_bf16_full_batch"):
        if not errors[key] <= max_error:
            problems.append(f"{key} {errors[key]:.2e} > {max_error}")
    return problems


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (f"{'case':<11} {'kind':<8} {'rows':>8} {'bf16 ms':>8} {'fp8 ms':>8} {'kernel':>8} {'quant':>7} "
              f"{'x kern':>6} {'gap b/f ms':>15} {'x gap':>6} {'err bf16':>8} {'err fp8':>8} {'fp8/bf16':>8} {'gap y':>8}")
    print(header)
    print("-" * len(header))
    for row in rows:
        ms, e = row["ms"], row["errors"]
        gap = f"{ms['gap_bf16']:.3f}/{ms['gap_fp8']:.3f}" if "gap_bf16" in ms else "-"
        gap_x = f"{ms['gap_bf16'] / ms['gap_fp8']:.3f}" if "gap_bf16" in ms else "-"
        print(f"{row['case']:<11} {row['kind']:<8} {row['rows']:>8} {ms['bf16']:>8.3f} {ms['fp8']:>8.3f} "
              f"{ms['fp8_kernel']:>8.3f} {ms['quantize']:>7.3f} {ms['bf16'] / ms['fp8_kernel']:>6.3f} {gap:>15} "
              f"{gap_x:>6} {e['bf16_vs_float64']:>8.1e} {e['fp8_vs_float64']:>8.1e} {e['fp8_vs_bf16_full_batch']:>8.1e} "
              f"{e.get('gap_y_fp8_vs_bf16', float('nan')):>8.1e}")  # fmt: skip
    print("ms: forward medians (no grad). fp8 = quantize pass + fp8 kernel; kernel = fp8 kernel on e4m3 inputs; "
          "x kern = bf16 / kernel; gap b/f = fused gap forward without/with fp8. err: relative (Frobenius) against "
          "float64 on the first sequences; fp8/bf16 and gap y: fp8 against bf16 on the whole batch.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, of: {', '.join(CASES)}")
    parser.add_argument("--kinds", default=",".join(KINDS), help="input kinds: uniform, silu")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved timing rounds")
    parser.add_argument("--max-error", type=float, default=0.1, help="fail above this fp8 relative error")
    parser.add_argument("--no-gap", action="store_true", help="skip the fused gap's variants")
    parser.add_argument("--smoke", action="store_true", help="one tiny case on the CPU (TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if args.smoke:
        device, cases, args.rounds = torch.device("cpu"), {"smoke": SMOKE_CASE}, 2
    elif not torch.cuda.is_available():
        print("attention_fp8 benchmark: needs a CUDA device (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
        unknown = [n for n in args.cases.split(",") if n not in CASES]
        if unknown:
            parser.error(f"unknown cases {unknown}; choose from {list(CASES)}")
        cases = {n: CASES[n] for n in args.cases.split(",")}
    kinds = args.kinds.split(",")
    if any(kind not in KINDS for kind in kinds):
        parser.error(f"--kinds: choose from {KINDS}, got {kinds}")
    rows, problems = [], []
    for name, case in cases.items():
        for kind in kinds:
            print(f"== {name} {kind}", file=sys.stderr, flush=True)
            rows.append(run_case(name, case, kind, args, device))
            problems += [f"{name} {kind}: {p}" for p in failed(rows[-1], args.max_error)]
            if device.type == "cuda":
                torch.cuda.empty_cache()
    print_table(rows)
    for problem in problems:
        print("FAILED", problem)
    if args.out:
        record = {
            "benchmark": "attention_fp8",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join([sys.executable, *sys.argv]),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter smoke)",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "seed": SEED,
            "cases": rows,
            "failures": problems,
        }
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2, default=str)
        print(f"wrote {args.out}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
