"""The MFU section: local compute efficiency per GPU, and scaling efficiency, reported apart.

The counting convention (:mod:`gem_model.model.flops`, docs/profiling.md): FLOPs of GEMM-like work
only (linears, attention products, the sampled-softmax dot products), over *real* tokens (no
padding), attention over the *causal* (query, key) pairs the HSTU mask keeps, backward counted as
twice the forward (a step is 3x the forward).

- local MFU = achieved FLOP/s per GPU / peak FLOP/s of one GPU, against two peaks: the datasheet's
  dense figure for the dtype the precision scheme's GEMMs run in
  (:attr:`PrecisionScheme.gemm_dtype <gem_model.components.PrecisionScheme.gemm_dtype>`; no figure
  for CPUs), and a matmul measured on this device in that dtype (what the device really reaches);
- scaling efficiency = N-GPU tokens/s / (N x one-GPU tokens/s): how much of the per-GPU throughput
  survives distribution. It needs a one-GPU measurement of the same config (``--baseline``).

On a GPU it also reports the power draw and SM clock during the unprofiled steps
(:mod:`gem_model.profiling.device_power`). A card held at its power limit runs below the clock its
datasheet peak assumes, and there a kernel that is faster alone can leave the step's time unchanged.
"""

from __future__ import annotations

import time

import torch

from gem_model.profiling.context import ProfileContext
from gem_model.profiling.device_power import joules_per_step
from gem_model.profiling.report import ProfileSection, ProfileTable
from gem_model.train.metrics import datasheet_peak, measure_cpu_peak

CAPPED_SHARE = 0.8
"""The share of samples at the power cap from which the section warns: the big config's timed steps on an
H100 were at it in 96-100 % (2026-12-06); a short profile whose warm-up steps tune kernels (mostly idle
device) showed 51 % at a median clock of 1,965 MHz, which is not a capped step."""
UNEVEN_STEPS = 1.5
"""The fastest unprofiled step's FLOP rate against the slowest's from which the section says the rates
are low: on the H100's big config (2026-12-06, ``--warmup 5``) the unprofiled steps averaged 871 ms where
the fastest took 157, the others tuning Triton kernels. Rates, not times: that config's batches differ in
size by up to 2x, and the rates of its tuned steps by much less than 1.5x."""
MATMUL_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def measure_matmul_peak(device: torch.device, gemm_dtype: str, *, n: int = 8192, iters: int = 20) -> float:
    """FLOP/s of a square ``n x n`` matmul in ``gemm_dtype`` on ``device`` (fp8 through ``_scaled_mm``)."""
    if device.type != "cuda":
        return measure_cpu_peak()
    if gemm_dtype == "float8":
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)

        def op() -> torch.Tensor:
            return torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        dtype = MATMUL_DTYPES[gemm_dtype]
        a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)

        def op() -> torch.Tensor:
            return a @ b

    for _ in range(3):
        op()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        op()
    torch.cuda.synchronize(device)
    return 2.0 * n**3 * iters / (time.perf_counter() - start)


def local_mfu(flops: float, seconds: float, world_size: int, peak: float) -> float:
    """Achieved FLOP/s per GPU over the peak of one GPU."""
    return flops / seconds / world_size / peak if seconds > 0 and peak > 0 else 0.0


def scaling_efficiency(tokens_per_s: float, world_size: int, one_gpu_tokens_per_s: float) -> float:
    """N-GPU throughput over N x the one-GPU throughput."""
    return tokens_per_s / (world_size * one_gpu_tokens_per_s)


def mfu_section(ctx: ProfileContext, *, baseline_tokens_per_s: float | None = None) -> ProfileSection:
    if ctx.measured is None or not ctx.measured.step_seconds:
        return ProfileSection("mfu", "MFU", notes=["no measured steps: run the step-time section"])
    m = ctx.measured
    # the profiler's own host cost is in the measured steps' time (on a CPU most of it): the rates
    # come from the unprofiled warm-up steps where there are any
    unprofiled = bool(m.unprofiled_step_seconds)
    if unprofiled:
        seconds, flops, tokens = sum(m.unprofiled_step_seconds), sum(m.unprofiled_flops), sum(m.unprofiled_tokens)
    else:
        seconds, flops, tokens = sum(m.step_seconds), sum(m.flops), sum(m.tokens)
    scheme = ctx.plugins.precision_schemes.get(ctx.config.precision.scheme.name).cls
    gemm = scheme.gemm_dtype
    sheet = datasheet_peak(ctx.device, gemm)
    measured_peak = measure_matmul_peak(ctx.device, gemm)
    world = m.world_size
    achieved = flops / seconds / world if seconds else 0.0
    tps = tokens / seconds if seconds else 0.0
    summary = {
        "gemm_dtype": gemm, "achieved_flops_per_gpu": achieved, "tokens_per_s": tps, "world_size": world,
        "datasheet_peak": None if sheet is None else sheet[0], "datasheet_source": None if sheet is None else sheet[1],
        "measured_matmul_peak": measured_peak,
        "mfu_datasheet": None if sheet is None else local_mfu(flops, seconds, world, sheet[0]),
        "mfu_measured_peak": local_mfu(flops, seconds, world, measured_peak),
        "scaling_efficiency": None,
    }  # fmt: skip
    notes = ["FLOPs: real tokens, causal attention pairs, backward = 2 x forward (docs/profiling.md)"]
    if unprofiled:
        notes.insert(0, f"from {len(m.unprofiled_step_seconds)} unprofiled warm-up step(s) (after the first): "
                     f"{1e3 * seconds / len(m.unprofiled_step_seconds):.1f} ms a step, against "
                     f"{1e3 * sum(m.step_seconds) / max(len(m.step_seconds), 1):.1f} ms under torch.profiler")  # fmt: skip
        rates = [f / t for f, t in zip(m.unprofiled_flops, m.unprofiled_step_seconds, strict=True) if t > 0 and f > 0]
        if rates and max(rates) > UNEVEN_STEPS * min(rates):
            notes.insert(1, f"the unprofiled steps ran {min(rates) / 1e12:.3g} to {max(rates) / 1e12:.3g} TFLOP/s: some of "
                         "them tuned or compiled kernels, so these rates are low; more --warmup steps give steadier ones")  # fmt: skip
    else:
        notes.insert(0, "from the profiled steps: torch.profiler's own host cost is in their time, so these rates "
                     "are low (--warmup 2 or more gives an unprofiled step to measure)")  # fmt: skip
    summary["unprofiled"] = unprofiled
    if sheet is None:
        notes.append(f"no datasheet peak for {ctx.device.type} ({gemm} GEMMs)")
    if world == 1:
        notes.append("scaling efficiency: one GPU, nothing to scale (1.0 by definition)")
        summary["scaling_efficiency"] = 1.0
    elif baseline_tokens_per_s:
        summary["scaling_efficiency"] = scaling_efficiency(tps, world, baseline_tokens_per_s)
    else:
        notes.append("scaling efficiency: not measured; pass --baseline DIR of a one-GPU profile of this config")

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{100 * v:.2f} %"

    summary["power"] = m.power
    power_rows = []
    if m.power is not None:
        p = m.power
        power_rows = [["SM clock in the unprofiled steps, MHz", f"{p['sm_mhz_median']:.0f} ({p['sm_mhz_min']:.0f}-{p['sm_mhz_max']:.0f})"],
                      ["power draw, W", f"{p['watts_median']:.0f} of {p['limit_watts']:.0f}"],
                      ["samples at the power cap", pct(p["power_capped_share"])]]  # fmt: skip
        energy = joules_per_step(p, 1e3 * seconds / len(m.unprofiled_step_seconds)) if unprofiled else None
        if energy is not None:  # at the cap, the figure a change must lower
            power_rows.append(["energy a step, J (mean power x mean step time)", f"{energy:.1f}"])
            summary["joules_per_step"] = energy
        if p["power_capped_share"] >= CAPPED_SHARE:
            notes.append(f"the GPU ran at its power cap in {100 * p['power_capped_share']:.0f} % of {p['samples']} samples "
                         f"(SM clock {p['sm_mhz_median']:.0f} MHz): a kernel that is faster alone may not make the step "
                         "faster; less energy a step does (fewer bytes moved, lower-precision GEMMs)")  # fmt: skip
    elif m.power_failure:
        notes.append(f"power and clock not sampled: {m.power_failure}")
    rows = [
        ["achieved TFLOP/s per GPU", achieved / 1e12],
        ["datasheet peak TFLOP/s", "-" if sheet is None else f"{sheet[0] / 1e12:.1f} ({sheet[1]})"],
        ["measured matmul peak TFLOP/s", measured_peak / 1e12],
        ["local MFU vs datasheet", pct(summary["mfu_datasheet"])],
        ["local MFU vs measured peak", pct(summary["mfu_measured_peak"])],
        ["tokens / s", tps],
        ["scaling efficiency", pct(summary["scaling_efficiency"])],
        *power_rows,
    ]
    return ProfileSection(
        name="mfu", title=f"MFU ({gemm} GEMMs)", summary=summary,
        tables=[ProfileTable("local compute efficiency and scaling efficiency", ["metric", "value"], rows)], notes=notes,
    )  # fmt: skip
