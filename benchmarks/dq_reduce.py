"""How the attention backward gets ``dq``, compared on the same inputs: a separate query-major pass
(``separate``: recomputes the scores, 8 MMAs per tile pair in all), fp32 atomics per element from the
key-major pass (``atomic``: 5 MMAs), or TMA bulk reductions of whole tiles from the key-major pass
(``tma``: 5 MMAs, one ``cp.reduce.async.bulk`` per tile step).

    python benchmarks/dq_reduce.py --cases big_config,fixed1024,fixed4096 --rounds 15 --out dq.json

Each variant is first checked against ``separate`` (dq, dk, dv; relative error of the fp32-accumulated
results, so a few 1e-3 at bf16 outputs) and against the float64 reference on the first sequences; then
the three backward passes of one recorded forward are timed in interleaved rounds (A B C, B C A, ...),
each round one CUDA-event-timed call per variant, after a warm-up that tuned every kernel. Reported:
median and IQR of ms per variant, TFLOP/s (backward counted as 2.5x the forward, NVIDIA's count).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from jagged_attention import CASES, make_inputs  # noqa: E402  (beside this script)

from gem_kernels import attention_triton_bwd  # noqa: E402
from gem_kernels.attention_triton_autograd import jagged_attention_triton  # noqa: E402
from gem_kernels.reference import jagged_attention_reference  # noqa: E402
from gem_kernels.testing import attention_errors  # noqa: E402

VARIANTS = {"separate": ("separate", False), "atomic": ("atomic", False), "tma": ("atomic", True)}


def grads(case, inputs, variant: str, subset: int | None = None):
    mode, tma = VARIANTS[variant]
    attention_triton_bwd.DQ_TMA = tma
    rows = None if subset is None else int(inputs["offsets"][subset])
    sl = slice(None) if rows is None else slice(0, rows)
    leaves = [inputs[n][sl].detach().requires_grad_() for n in ("q", "k", "v")]
    offsets = inputs["offsets"] if subset is None else inputs["offsets"][: subset + 1]
    out = jagged_attention_triton(*leaves, offsets, max_seq_len=case.max_seq_len, alpha=1.0 / case.dim, dq_mode=mode)
    return leaves, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="big_config,fixed1024,fixed4096")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out")
    args = p.parse_args()
    device = torch.device("cuda")
    record = {"benchmark": "dq_reduce", "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "command": " ".join(sys.argv),
              "cases": {}}  # fmt: skip
    print(f"{'case':<11} {'variant':<9} {'err vs separate':>16} {'err vs ref':>11} {'ms q1/med/q3':>22} {'TFLOP/s':>8} {'x separate':>10}")
    for name in args.cases.split(","):
        case = CASES[name]
        inputs = make_inputs(case, device)
        work = 2.5 * 2 * case.heads * 2 * case.dim * inputs["squares"] / 2
        g = inputs["grad_out"]
        # correctness: the full batch against separate, the first sequences against float64
        results = {}
        for v in VARIANTS:
            leaves, out = grads(case, inputs, v)
            results[v] = torch.autograd.grad(out, leaves, g)
        sub = 8 if case.max_seq_len >= 4096 else 32
        sub_rows = int(inputs["offsets"][sub])
        ref_leaves = [inputs[n][:sub_rows].detach().double().requires_grad_() for n in ("q", "k", "v")]
        ref_out = jagged_attention_reference(*ref_leaves, inputs["offsets"][: sub + 1], max_seq_len=case.max_seq_len,
                                             alpha=1.0 / case.dim)  # fmt: skip
        ref = torch.autograd.grad(ref_out, ref_leaves, g[:sub_rows].double())
        errors = {}
        for v in VARIANTS:
            vs_sep = max(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))
                         for a, b in zip(results[v], results["separate"]))  # fmt: skip
            leaves, out = grads(case, inputs, v, subset=sub)
            mine = torch.autograd.grad(out, leaves, g[:sub_rows])
            vs_ref = max(float((a.double() - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(mine, ref))
            errors[v] = (vs_sep, vs_ref)
        del results
        # timing: one recorded forward per variant, backward interleaved in rotated order
        graphs = {v: grads(case, inputs, v) for v in VARIANTS}
        names = list(VARIANTS)

        def backward(v: str) -> float:
            attention_triton_bwd.DQ_TMA = VARIANTS[v][1]
            leaves, out = graphs[v]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.autograd.grad(out, leaves, g, retain_graph=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        for _ in range(3):
            for v in names:
                backward(v)
        times = {v: [] for v in names}
        for r in range(args.rounds):
            for j in range(len(names)):
                v = names[(r + j) % len(names)]
                times[v].append(backward(v))
        rows = {}
        sep_med = statistics.median(times["separate"])
        for v in names:
            q1, med, q3 = statistics.quantiles(times[v], n=4, method="inclusive")
            med = statistics.median(times[v])
            rows[v] = {"ms_q1": q1, "ms_median": med, "ms_q3": q3, "tflops": work / med / 1e9,
                       "err_vs_separate": errors[v][0], "err_vs_reference": errors[v][1], "times_ms": times[v]}  # fmt: skip
            print(f"{name:<11} {v:<9} {errors[v][0]:>16.2e} {errors[v][1]:>11.2e} {q1:>7.3f}/{med:>6.3f}/{q3:>6.3f} "
                  f"{work / med / 1e9:>8.1f} {sep_med / med:>9.3f}x")  # fmt: skip
        record["cases"][name] = rows
        del graphs, inputs
        torch.cuda.empty_cache()
    attention_triton_bwd.DQ_TMA = True
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
