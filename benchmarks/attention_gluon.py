"""The Gluon attention kernels (gem_kernels.attention_gluon: the forward, the dq pass and the dk/dv pass)
against the Triton ones, on one sm_90 GPU.

Cases are benchmarks/jagged_attention.py's: ``big_config`` (B=384, H=8, D=128, power-law lengths up to
4096 with one target: configs/h200-large.yaml's), ``fixed1024/2048/4096`` (B=512, H=4, D=128, every
sequence N long: NVIDIA's uniform-length protocol), ``n1024_s0.3`` (short histories), plus ``edges``:
lengths around the tiles' sizes (0, 1, 63, 64, 65, 127, 128, 129, 191, 4095, ...) with 0-20 targets.

Inputs are fresh random draws per case (``--seed``; seeded from the clock when not given, and printed):
q, k, v and the output gradient = silu of N(0, 1), as the fused block's silu pass writes them,
alpha = 1/sqrt(D).

First the check, per case, pass and Gluon config, before any timing:

* the Gluon result over the whole batch (the output; ``dq``; ``dk`` and ``dv``) against the Triton
  kernels' (the separate ``dq`` pass; ``key_major`` without atomic ``dq``), written into NaN-filled
  tensors (a row left unwritten fails): relative error at most ``--max-error`` (default 1e-2: both round
  ``P`` and ``ds`` to bf16 in the same places, and sum in a different order);
* both against float64 on the first sequences (jagged_attention_reference and its autograd): Gluon's
  error at most twice Triton's plus 1e-3.

Then each pass whose configs all passed is timed: the configs and the Triton kernel in rotated order
over ``--rounds`` rounds (``rounds.rotated_rounds``: CUDA events, one warm-up call each, which compiles
and tunes), as medians with their quartiles, and TFLOP/s by jagged_attention.py's count (the causal
half of each sequence; the dq pass 1.5x the forward's FLOPs, the dk/dv pass 2x).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/attention_gluon.py --out attention_gluon.json

Exit status 1 when a check fails; ``--cases``, ``--configs``, ``--dq-configs`` and ``--dkdv-configs``
narrow the run ('' skips a pass). ``--isolate SECONDS`` checks each kernel config in a process of its
own with a time limit, so a kernel that hangs or faults does not take the others down (the first run
of kernels that have never run):

    python benchmarks/attention_gluon.py --isolate 120 --cases edges,big_config --out attention_gluon_checks.json
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jagged_attention import CASES, Case, flops, sample_lengths
from rounds import cell, rotated_rounds, save_results, spread

from gem_kernels import attention_gluon
from gem_kernels.attention_triton import query_major
from gem_kernels.attention_triton_autograd import last_configs
from gem_kernels.attention_triton_bwd import key_major
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


PASSES = ("forward", "dq", "dkdv")
MMAS = {"forward": 2, "dq": 3, "dkdv": 4}
"""MMAs of a (query block, key block) pair in each pass: its FLOPs are MMAS / 2 times the forward's."""


def triton_pass(x: dict[str, Any], which: str, out: tuple[torch.Tensor, ...] | None = None) -> tuple[torch.Tensor, ...]:
    """The Triton kernels' forward output, ``dq`` (the separate pass), or ``(dk, dv)`` (no atomic ``dq``)."""
    q, k, v, g, offsets, targets, options = x["q"], x["k"], x["v"], x["grad_out"], x["offsets"], x["targets"], x["options"]
    if which == "dkdv":
        return key_major(q, k, v, g, offsets, targets, None, out=out, **options)
    first = None if out is None else out[0]
    return (query_major(q, k, v, g if which == "dq" else None, offsets, targets, out=first, **options),)


def gluon_pass(x: dict[str, Any], which: str, config: str, out: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    o = dict(max_seq_len=x["options"]["max_seq_len"], alpha=x["options"]["alpha"], config=config,
             programs=x.get("programs"))
    q, k, v, g, offsets, targets = x["q"], x["k"], x["v"], x["grad_out"], x["offsets"], x["targets"]
    if which == "forward":
        return (attention_gluon.forward(q, k, v, offsets, targets, out=out[0], **o),)
    if which == "dq":
        return (attention_gluon.dq(q, k, v, g, offsets, targets, out=out[0], **o),)
    return attention_gluon.dkdv(q, k, v, g, offsets, targets, out=out, **o)


def reference(x: dict[str, Any], which: str) -> tuple[int, tuple[torch.Tensor, ...]]:
    """The float64 kernel's result on the first sequences (up to ``REFERENCE_ROWS`` rows): their row
    count and the output, ``dq``, or ``(dk, dv)``."""
    offsets = x["offsets"].cpu()
    seqs = max(1, int((offsets[1:] <= REFERENCE_ROWS).sum()))
    rows = int(offsets[seqs])
    targets = None if x["targets"] is None else x["targets"][:seqs]
    o = x["options"]
    leaves = [x[n][:rows].double().requires_grad_(which != "forward") for n in ("q", "k", "v")]
    out = jagged_attention_reference(
        *leaves, x["offsets"][: seqs + 1],
        max_seq_len=o["max_seq_len"], alpha=o["alpha"], extras=AttentionExtras(num_targets=targets),
    )
    if which == "forward" or rows == 0:
        return rows, (out,)
    grads = torch.autograd.grad(out, leaves, x["grad_out"][:rows].double())
    return rows, (grads[0],) if which == "dq" else (grads[1], grads[2])


def _error(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...], rows: int | None = None) -> float:
    """The largest relative error over the parts (``dk`` and ``dv``), on the first ``rows`` rows if given."""
    return max(relative_error(a[:rows].double(), e.double()) if e.numel() else 0.0 for a, e in zip(actual, expected))


def worst_sequence(x: dict[str, Any], actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> str:
    """Where a result departs most from the Triton kernels': the sequence (its index, length, targets),
    the head and the row within the sequence, and how many sequences depart by more than 1 %: what a
    failing kernel gets wrong (short sequences, targets, the last block...) at a glance."""
    part = max(range(len(actual)), key=lambda i: _error(actual[i:i + 1], expected[i:i + 1]))  # dk or dv
    a, e = actual[part].double(), expected[part].double()
    row_err = ((a - e).norm(dim=-1) / e.norm(dim=-1).clamp_min(1e-30)).nan_to_num(float("inf"))  # [L, H]
    offsets = x["offsets"].cpu().tolist()
    per_seq = [float(row_err[s:t].max()) if t > s else 0.0 for s, t in itertools.pairwise(offsets)]
    b = max(range(len(per_seq)), key=per_seq.__getitem__)
    flat = int(row_err[offsets[b]:offsets[b + 1]].argmax())
    row, head = divmod(flat, row_err.shape[1])
    targets = 0 if x["targets"] is None else int(x["targets"][b])
    bad = sum(e > 1e-2 for e in per_seq)
    return (f"sequence {b} (length {offsets[b + 1] - offsets[b]}, {targets} targets) row {row} head {head}: "
            f"{per_seq[b]:.3g}; {bad} of {len(per_seq)} sequences above 1e-2")  # fmt: skip


def check(x: dict[str, Any], which: str, configs: list[str], max_error: float,
          run: Callable[[dict[str, Any], str, str, tuple[torch.Tensor, ...]], object] = gluon_pass) -> dict[str, Any]:
    """Every config's result of pass ``which`` against the Triton kernels' and against float64;
    ``failures`` lists what failed. Each config writes into NaN-filled outputs."""
    base = triton_pass(x, which)
    outputs = {"triton": base}
    for config in configs:
        out = tuple(torch.full_like(b, float("nan")) for b in base)
        run(x, which, config, out)
        outputs[config] = out
    rows, exact = reference(x, which)
    vs_exact = {name: _error(out, exact, rows) for name, out in outputs.items()}
    result: dict[str, Any] = {"against_triton": {}, "against_float64": vs_exact, "failures": [], "worst": {}}
    for config in configs:
        err = _error(outputs[config], base)
        result["against_triton"][config] = err
        if not err <= max_error:  # NaN fails
            worst = worst_sequence(x, outputs[config], base)
            result["worst"][config] = worst
            result["failures"].append(f"{which} {config}: {err:.3g} from the Triton kernel (limit {max_error}); "
                                      f"worst: {worst}")  # fmt: skip
        if not vs_exact[config] <= 2 * vs_exact["triton"] + 1e-3:
            result["failures"].append(f"{which} {config}: {vs_exact[config]:.3g} from float64, "
                                      f"Triton {vs_exact['triton']:.3g}")  # fmt: skip
    return result


def kernel_calls(x: dict[str, Any], which: str, configs: list[str]) -> dict[str, Callable[[], object]]:
    """Pass ``which`` as calls: the Triton kernels' (``"triton"``) and each Gluon config's, the latter
    into outputs allocated once (shapes from one Triton call)."""
    shapes = triton_pass(x, which)
    fns: dict[str, Callable[[], object]] = {"triton": lambda: triton_pass(x, which)}
    for config in configs:
        outs = tuple(torch.empty_like(b) for b in shapes)
        fns[config] = lambda c=config, o=outs: gluon_pass(x, which, c, o)
    return fns


def pass_configs(args: argparse.Namespace) -> dict[str, list[str]]:
    """The Gluon configs asked for, by pass."""
    return {"forward": args.configs, "dq": args.dq_configs, "dkdv": args.dkdv_configs}


def case_inputs(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """Case ``name``'s inputs, with the Gluon grid size asked for."""
    return {**make_inputs(name, args.seed, device), "programs": args.programs}


def run_case(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    x = case_inputs(name, args, device)
    case = x["case"]
    row: dict[str, Any] = {"case": name, "rows": int(x["offsets"][-1]), "batch": len(x["lengths"]), "heads": case.heads,
                           "dim": case.dim, "seed": args.seed, "checks": {}, "timed": {}}  # fmt: skip
    configs = pass_configs(args)
    for which in PASSES:
        if configs[which]:
            row["checks"][which] = check(x, which, configs[which], args.max_error)
    if name == "edges":
        return row  # a correctness case, not a speed one
    work = flops(case, x["squares"])[0]
    for which in PASSES:
        if not configs[which] or row["checks"][which]["failures"] or args.rounds <= 0:
            continue  # a config that fails is not timed
        times = rotated_rounds(kernel_calls(x, which, configs[which]), args.rounds)
        scale = MMAS[which] / 2
        row["timed"][which] = {n: {**spread(ms), "tflops": scale * work / spread(ms)["median"] / 1e9}
                               for n, ms in times.items()}  # fmt: skip
    # which tiles the Triton kernels ran here: their tuner picks per length bucket, and a table that
    # names the Triton row's tiles has to take them from here (session 28's said 64 x 64; the grid that
    # Nsight Compute saw, 3 programs an SM, was the 64 x 32 config's)
    row["triton_configs"] = last_configs()
    return row


def print_table(rows: list[dict[str, Any]], which: str) -> None:
    print(f"\n| case | kernel | {which} ms (q1-q3) | TFLOP/s | against Triton | error vs Triton | vs float64 |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        c = row["checks"].get(which)
        if c is None:
            continue
        timed = row["timed"].get(which, {})
        base = timed.get("triton", {}).get("median")
        for name in ["triton", *c["against_triton"]]:
            t = timed.get(name)
            speed = f"{base / t['median']:.3f}x" if t and base else "-"
            vs_triton = "-" if name == "triton" else f"{c['against_triton'][name]:.2e}"
            timing = f"{cell(t)} | {t['tflops']:.0f}" if t else "- | -"
            print(f"| {row['case']} | {name} | {timing} | {speed} | {vs_triton} | {c['against_float64'][name]:.2e} |")
        for failure in c["failures"]:
            print(f"FAILED {row['case']}: {failure}")
        if row.get("triton_configs", {}).get(which):  # the pass names are the Triton kernels' names
            print(f"  ({row['case']}: the Triton {which} ran {row['triton_configs'][which]})")


def _check_alone(args: argparse.Namespace, timeout_s: float, flag: str, config: str) -> tuple[str, list[str], dict, float]:
    """One kernel config checked in a process of its own: (verdict, detail, its --out record, seconds)."""
    import json
    import subprocess
    import tempfile

    passes = {"--configs": "", "--dq-configs": "", "--dkdv-configs": "", flag: config}
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [sys.executable, os.path.abspath(__file__), "--cases", ",".join(args.cases), "--seed",
                   str(args.seed), "--rounds", "0", "--max-error", str(args.max_error), "--out", out.name,
                   *(a for k, v in passes.items() for a in (k, v)),
                   *(["--programs", str(args.programs)] if args.programs else [])]  # fmt: skip
        started = time.perf_counter()
        try:
            run = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
            verdict = "passed" if run.returncode == 0 else ("failed" if run.returncode == 1 else "crashed")
            detail = [line for line in run.stdout.splitlines() if line.startswith("FAILED")]
            if verdict == "crashed" or (verdict == "failed" and not detail):
                verdict, detail = "crashed", run.stderr.strip().splitlines()[-3:]
            record = json.loads(Path(out.name).read_text() or "{}") if verdict != "crashed" else {}
        except subprocess.TimeoutExpired:
            verdict, detail, record = "hung", [f"no exit in {timeout_s:.0f} s"], {}
    return verdict, detail, record, time.perf_counter() - started


def isolated(args: argparse.Namespace, timeout_s: float) -> int:
    """Each (pass, config) checked alone in a process of its own on ``--cases`` (no timing), with a
    time limit: a kernel that hangs on a barrier or faults takes only its own process down. ``--jobs``
    processes run at once (they share the GPU; a check does not time anything). Prints one line per
    kernel (passed, failed with the check's reason, crashed with the tail of its stderr, or hung) and
    keeps them in ``--out``."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    kernels = [("--configs", "forward", c) for c in args.configs] + [
        ("--dq-configs", "dq", c) for c in args.dq_configs] + [("--dkdv-configs", "dkdv", c) for c in args.dkdv_configs]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "none seen by the parent"
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": device,
            "command": " ".join(sys.argv), "seed": args.seed, "isolated": True}  # fmt: skip
    results = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        futures = [pool.submit(_check_alone, args, timeout_s, flag, config) for flag, _, config in kernels]
        for (_, which, config), future in zip(kernels, futures):
            verdict, detail, record, seconds = future.result()
            print(f"{which:<8} {config:<12} {verdict:<8} {seconds:6.1f} s  {'; '.join(detail)[:400]}", flush=True)
            results.append({"pass": which, "config": config, "verdict": verdict, "detail": detail,
                            "seconds": seconds, "checks": [r.get("checks") for r in record.get("results", [])]})
            if args.out:  # after each kernel: a later hang or crash loses nothing
                Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0 if all(r["verdict"] == "passed" for r in results) else 1


def once(args: argparse.Namespace, device: torch.device) -> int:
    """For a profiler: per case, every listed kernel (the Triton one and each config of each pass) called
    once to compile, then once more between ``cudaProfilerStart`` and ``cudaProfilerStop`` (wrap it in
    ``ncu --profile-from-start off``). No check, no timing."""
    configs = pass_configs(args)
    for name in args.cases:
        x = case_inputs(name, args, device)
        calls = [fn for which in PASSES if configs[which] for fn in kernel_calls(x, which, configs[which]).values()]
        for call in calls:
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for call in calls:
            call()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"{name}: {len(calls)} kernels called once for the profiler", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--configs", default=",".join(attention_gluon.CONFIGS))
    parser.add_argument("--dq-configs", default=",".join(attention_gluon.DQ_CONFIGS),
                        help="the dq pass's configs to check and time ('' for none)")
    parser.add_argument("--dkdv-configs", default=",".join(attention_gluon.DKDV_CONFIGS),
                        help="the dk/dv pass's configs ('' for none)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--max-error", type=float, default=1e-2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--programs", type=int, default=None,
                        help="the Gluon kernels' grid size (1: every tile in one program, for a failing check)")
    parser.add_argument("--isolate", type=float, default=None, metavar="SECONDS",
                        help="check each kernel config in a process of its own with this time limit (no timing)")
    parser.add_argument("--once", action="store_true",
                        help="call each kernel once between cudaProfilerStart/Stop, for ncu (no check, no timing)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="with --isolate: how many of those processes run at once")
    args = parser.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    args.configs = [c for c in args.configs.split(",") if c]
    args.dq_configs = [c for c in args.dq_configs.split(",") if c]
    args.dkdv_configs = [c for c in args.dkdv_configs.split(",") if c]
    unknown = [c for c in args.cases if c != "edges" and c not in CASES] + [
        c for c in args.configs if c not in attention_gluon.CONFIGS] + [
        c for c in args.dq_configs if c not in attention_gluon.DQ_CONFIGS] + [
        c for c in args.dkdv_configs if c not in attention_gluon.DKDV_CONFIGS]
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    if unknown:
        parser.error(f"unknown case or config: {', '.join(unknown)} (cases: edges, {', '.join(CASES)}; "
                     f"configs: {', '.join(attention_gluon.CONFIGS)})")  # fmt: skip
    if args.seed is None:
        args.seed = int(time.time()) % 100_000
    print(f"seed {args.seed}", flush=True)
    if args.isolate is not None:
        return isolated(args, args.isolate)
    device = torch.device("cuda")
    q = torch.zeros(1, 1, 128, dtype=torch.bfloat16, device=device)
    if not attention_gluon.supported(q, q, q):
        print(f"the Gluon forward does not run here ({torch.cuda.get_device_name()}): it needs sm_90")
        return 1
    if args.once:
        return once(args, device)
    rows = []
    for name in args.cases:
        rows.append(run_case(name, args, device))
        save_results(args.out, rows, seed=args.seed)
        print(f"{name}: checked{' and timed' if args.rounds else ''}", flush=True)
    for which in PASSES:
        print_table(rows, which)
    return 1 if any(c["failures"] for r in rows for c in r["checks"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
