"""Energy a call of the big config's main kernels, on the GPU at hand: where a step's joules go.

At the card's power cap (700 W on the H100 and H200) a step's time is its energy over the cap: on one
H100 (2026-12-06) `fp8_rowwise` ran 1.063x faster than bf16 over steady rounds and took 1.061x less
energy a step (`e2e_ab.py`). A kernel that gets faster but moves the same bytes and runs the same
MMAs leaves the step as it was. So what a change can win is what it saves of these figures, not of
its kernels' times.

Each kernel runs back to back for ``--seconds`` while ``nvidia-smi`` samples the board's instantaneous
power and the SM clock (``gem_model.profiling.device_power``); the samples of the first ``--settle``
seconds are left out (the clock needs that long to settle). Energy a call = mean power x device time a
call (CUDA events over the same calls). The kernels go in rotated rounds; the table gives the medians.

Kernels (one HSTU block of ``configs/h200-large.yaml``, ``--rows`` tokens; attention on the config's
power-law lengths, 384 sequences of 8 heads of 128, ~200,000 rows):

- ``uvqk_fwd`` / ``uvqk_dgrad`` / ``uvqk_wgrad``: cuBLAS, ``x [N, 1024] -> [N, 4096]`` and its two gradients;
- ``out_fwd``: cuBLAS, ``[N, 1024] -> [N, 1024]``;
- ``uvqk_fwd_fp8``: the same forward as e4m3 with row scales (``torch._scaled_mm``), quantization not counted;
- ``attention_forward`` / ``attention_dq`` / ``attention_dkdv``: the three attention passes as shipped (the
  Triton forward and dq pass, the Gluon dk/dv pass on sm_90);
- ``attention_forward@BMxBNxWxSxP`` / ``attention_dq@...`` / ``attention_dkdv@NAME``: each pass with each of
  its candidate configs pinned (the tuner picks by short runs below the cap);
- ``attention_forward_fp8``: the forward with ``q k^T`` in e4m3 (``fp8_forward``), its inputs cast before;
- ``attention_backward`` / ``attention_backward_atomic`` / ``attention_backward_stored``: the whole backward as
  shipped, with ``dq`` added by float32 atomics in the (Triton) key-major pass instead of its own pass, and
  with ``dq`` from the ``ds`` tiles the key-major pass stores (``attention_dkdv_stored`` and
  ``attention_dq_stored``: its two passes alone);
- ``uvqk_wgrad_fp8_blocks`` / ``cast_t_blocks``: uvqk's weight gradient in e4m3 with 1 x 128 block scales,
  and the passes that make its transposed operands, as ``weight_gradient: fp8_blocks`` runs them;
- ``copy``: ``[N, 4096]`` bf16 copied, the bytes-only reference.

Every kernel is checked before it is measured: the GEMMs against float32 products, the attention passes
against the float64 reference on the first sequences (``attention_gluon.check``).

    python benchmarks/kernel_energy.py --seconds 3 --rounds 3 --out kernel_energy.json

``pJ/FLOP`` counts the MMAs each kernel runs (the attention passes by ``attention_gluon.MMAS``: 2, 3 and 4
MMAs a (query, key) pair), ``pJ/byte`` the bytes a kernel must move at least.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from energy_kernel import Kernel, refuse_if_wrong  # beside this script
from kernel_energy_attention import attention_kernels  # beside this script
from rounds import save_results  # beside this script

from gem_model.profiling.device_power import sampler_for, summarize
from gem_precision.blockwise_weight_grad import block_scaled_mm, block_scaled_operands
from gem_precision.formats import E4M3
from gem_precision.fp8_reference import quantize_fp8_reference

D, WIDE = 1024, 4096
ESTIMATE_CALLS = 3
"""Calls timed to size a kernel's run of ``--seconds`` (after one untimed call)."""
FP8_BLOCKS_TOLERANCE = 0.06
"""e4m3 with 1 x 128 block scales against the float32 product: 0.036-0.039 on normal data
(``gem-precision``'s ``test_weight_gradient.py``)."""


def _draw(gen: torch.Generator, device: torch.device, *shape: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=device) * 0.5).to(torch.bfloat16)


def gemm_kernels(rows: int, device: torch.device, gen: torch.Generator) -> dict[str, Kernel]:
    x, w, b, g = (
        _draw(gen, device, rows, D),
        _draw(gen, device, WIDE, D),
        _draw(gen, device, WIDE),
        _draw(gen, device, rows, WIDE),
    )
    w_out, a = _draw(gen, device, D, D), _draw(gen, device, rows, D)
    # e4m3 with a power-of-two scale per row of x and of W (fp8_rowwise's operands; quantization not timed)
    xr = quantize_fp8_reference(x, granularity="row", fmt=E4M3).rows
    wr = quantize_fp8_reference(w, granularity="row", fmt=E4M3).rows
    n = 2.0 * rows * D * WIDE
    out_b, dx, dw = (
        torch.empty(rows, WIDE, device=device, dtype=torch.bfloat16),
        torch.empty_like(x),
        torch.empty_like(w),
    )
    out_a = torch.empty_like(a)
    kernels = {
        "uvqk_fwd": Kernel(lambda: torch.addmm(b, x, w.T, out=out_b), n),
        # the same product without the bias epilogue (cuBLAS may pick another kernel for it)
        "uvqk_fwd_nobias": Kernel(lambda: torch.mm(x, w.T, out=out_b), n),
        "uvqk_dgrad": Kernel(lambda: torch.mm(g, w, out=dx), n),
        "uvqk_wgrad": Kernel(lambda: torch.mm(g.T, x, out=dw), n),
        "out_fwd": Kernel(lambda: torch.mm(a, w_out.T, out=out_a), 2.0 * rows * D * D),
        "uvqk_fwd_fp8": Kernel(lambda: torch._scaled_mm(xr.data, wr.data.t(), xr.scale_inv, wr.scale_inv.t(),
                                                        out_dtype=torch.bfloat16), n),
    }  # fmt: skip
    probe = slice(0, 2048)
    exact = x[probe].float() @ w.float().T
    checks = (("uvqk_fwd", exact + b.float(), 1e-2), ("uvqk_fwd_nobias", exact, 1e-2), ("uvqk_fwd_fp8", exact, 0.08),
              ("uvqk_dgrad", g[probe].float() @ w.float(), 1e-2), ("uvqk_wgrad", g.float().T @ x.float(), 1e-2))  # fmt: skip
    for name, want, tolerance in checks:
        got = kernels[name].call()
        refuse_if_wrong(name, got if name == "uvqk_wgrad" else got[probe], want, tolerance)
    src, dst = _draw(gen, device, rows, WIDE), torch.empty(rows, WIDE, device=device, dtype=torch.bfloat16)
    kernels["copy"] = Kernel(lambda: dst.copy_(src), 0.0, 2.0 * src.numel() * 2)
    return kernels


def fp8_weight_grad_kernels(rows: int, device: torch.device, gen: torch.Generator) -> dict[str, Kernel]:
    """uvqk's weight gradient as ``fp8_rowwise``'s ``weight_gradient: fp8_blocks`` runs it
    (:mod:`gem_precision.blockwise_weight_grad`): the e4m3 GEMM with 1 x 128 block scales, and the passes
    that cast and transpose ``g`` and ``x`` for it. Whether a separate pass pays in energy where it lost
    in time (``e2e_ab.md``, 2026-12-05)."""
    x, g = _draw(gen, device, rows, D), _draw(gen, device, rows, WIDE)
    native = device.type == "cuda"
    gq, xq = block_scaled_operands(g, x, native=native)
    refuse_if_wrong("uvqk_wgrad_fp8_blocks", block_scaled_mm(gq, xq, native=native), g.float().T @ x.float(),
                     FP8_BLOCKS_TOLERANCE)  # fmt: skip
    return {
        "uvqk_wgrad_fp8_blocks": Kernel(lambda: block_scaled_mm(gq, xq, native=native), 2.0 * rows * D * WIDE),
        "cast_t_blocks": Kernel(lambda: block_scaled_operands(g, x, native=native), 0.0, 3.0 * (g.numel() + x.numel())),
    }


def measure(kernel: Kernel, seconds: float, settle: float, sampler: Any) -> dict[str, float]:
    """One kernel run back to back for ``seconds``: device ms a call, and from the samples after ``settle``
    seconds the mean power, the median SM clock, the power-cap share and the energy a call."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t = time.perf_counter()
    kernel.call()  # a first call may set up (cuBLAS picks its kernel): not in the estimate of a call's time
    torch.cuda.synchronize()
    start.record()
    for _ in range(ESTIMATE_CALLS):
        kernel.call()
    end.record()
    end.synchronize()
    calls = max(4, int(seconds * 1e3 / max(start.elapsed_time(end) / ESTIMATE_CALLS, 1e-3)))
    t0 = time.perf_counter()
    start.record()
    for _ in range(calls):
        kernel.call()
    end.record()
    end.synchronize()
    t1 = time.perf_counter()
    ms = start.elapsed_time(end) / calls
    power = summarize(sampler.within([(t0 + settle, t1)])) if sampler is not None else None
    row = {"ms": ms, "calls": calls, "window_s": t1 - t0, "since_first_call_s": t1 - t}
    if power is not None:
        row.update(watts=power["watts_mean"], sm_mhz=power["sm_mhz_median"], capped=power["power_capped_share"],
                   samples=power["samples"], joules=power["watts_mean"] * ms / 1e3)  # fmt: skip
    return row


def per_unit(joules: float | None, amount: float) -> float | None:
    return None if joules is None or amount <= 0 else joules / amount * 1e12


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=0, help="tokens of the GEMMs (default: the attention case's rows)")
    p.add_argument("--seconds", type=float, default=3.0, help="how long each kernel runs back to back")
    p.add_argument("--settle", type=float, default=1.0, help="seconds of samples left out at each kernel's start")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--power-ms", type=int, default=50)
    p.add_argument("--kernels", default="", help="comma-separated subset (default: all)")
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.settle >= args.seconds:
        p.error(f"--settle ({args.settle}) must be shorter than --seconds ({args.seconds})")
    if not torch.cuda.is_available():
        raise SystemExit("kernel_energy.py measures a GPU; none is visible")
    device = torch.device("cuda")
    wanted = [k for k in args.kernels.split(",") if k]
    kernels, rows = attention_kernels(args.seed, device, configs=not wanted or any("@" in k for k in wanted))
    gen = torch.Generator(device).manual_seed(args.seed)
    kernels = {**gemm_kernels(args.rows or rows, device, gen), **fp8_weight_grad_kernels(args.rows or rows, device, gen),
               **kernels}  # fmt: skip
    if args.kernels:
        unknown = sorted(set(args.kernels.split(",")) - set(kernels))
        if unknown:
            p.error(f"unknown kernels {unknown}; known: {sorted(kernels)}")
        kernels = {k: v for k, v in kernels.items() if k in args.kernels.split(",")}
    sampler = sampler_for(device, args.power_ms, "power.draw.instant")
    sampler.start()
    names = list(kernels)
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    try:
        for r in range(args.rounds):
            for j in range(len(names)):
                name = names[(r + j) % len(names)]
                results[name].append(measure(kernels[name], args.seconds, args.settle, sampler))
    finally:
        sampler.stop()
    if sampler.failure:
        print(f"power not sampled: {sampler.failure}")
    rows_out = []
    print(f"\n{'kernel':<20} {'ms a call':>10} {'TFLOP/s':>8} {'W':>6} {'SM MHz':>7} {'capped':>7} {'J a call':>9} "
          f"{'pJ/FLOP':>8} {'pJ/byte':>8}")  # fmt: skip
    for name in names:
        runs = results[name]

        def med(key: str, runs: list[dict[str, float]] = runs) -> float | None:
            vals = [r[key] for r in runs if key in r]
            return statistics.median(vals) if vals else None

        ms, joules = med("ms"), med("joules")
        k = kernels[name]
        row = {"kernel": name, "ms": ms, "watts": med("watts"), "sm_mhz": med("sm_mhz"), "capped": med("capped"),
               "joules": joules, "flops": k.flops, "bytes": k.bytes, "pj_per_flop": per_unit(joules, k.flops),
               "pj_per_byte": per_unit(joules, k.bytes), "runs": runs}  # fmt: skip
        rows_out.append(row)

        def f(v: float | None, spec: str) -> str:
            return "-" if v is None else format(v, spec)

        tflops = k.flops / ms / 1e9 if k.flops else None
        print(f"{name:<20} {ms:>10.3f} {f(tflops, '.0f'):>8} {f(row['watts'], '.0f'):>6} {f(row['sm_mhz'], '.0f'):>7} "
              f"{f(None if row['capped'] is None else 100 * row['capped'], '.0f'):>6}% {f(joules, '.4f'):>9} "
              f"{f(row['pj_per_flop'], '.3f'):>8} {f(row['pj_per_byte'], '.1f'):>8}")  # fmt: skip
    save_results(args.out, rows_out, rows=args.rows or rows, seconds=args.seconds, settle=args.settle,
                 rounds=args.rounds, power_ms=args.power_ms, power_failure=sampler.failure)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
