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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_gluon import MMAS, check, gluon_pass, make_inputs, triton_pass  # beside this script
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
ATTENTION_TOLERANCE = 1e-2
"""The shipped passes are ~2.3e-3 from float64 on the first sequences (bf16 inputs and outputs)."""


@dataclass
class Kernel:
    call: Callable[[], object]
    flops: float = 0.0
    """FLOPs of the MMAs a call runs."""
    bytes: float = 0.0
    """Bytes a call must move through HBM at least."""


def _refuse_if_wrong(name: str, got: torch.Tensor, want: torch.Tensor, tolerance: float,
                     against: str = "the float32 product") -> None:  # fmt: skip
    """End the run before ``name`` is measured if its result is not within ``tolerance`` (relative, by
    norm) of ``want``, which is ``against``."""
    want = want.float()
    error = ((got.float() - want).norm() / want.norm().clamp(min=1e-30)).item()
    if not error <= tolerance:
        raise SystemExit(f"{name}: relative error {error:.2e} against {against} (limit {tolerance}), "
                         "refusing to measure it")  # fmt: skip


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
        _refuse_if_wrong(name, got if name == "uvqk_wgrad" else got[probe], want, tolerance)
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
    _refuse_if_wrong("uvqk_wgrad_fp8_blocks", block_scaled_mm(gq, xq, native=native), g.float().T @ x.float(),
                     FP8_BLOCKS_TOLERANCE)  # fmt: skip
    return {
        "uvqk_wgrad_fp8_blocks": Kernel(lambda: block_scaled_mm(gq, xq, native=native), 2.0 * rows * D * WIDE),
        "cast_t_blocks": Kernel(lambda: block_scaled_operands(g, x, native=native), 0.0, 3.0 * (g.numel() + x.numel())),
    }


def attention_kernels(seed: int, device: torch.device, *, configs: bool = True) -> tuple[dict[str, Kernel], int]:
    """The attention rows; ``configs``: with each pass's pinned configs (:func:`attention_configs`, which
    compiles, runs and checks every candidate first)."""
    x = make_inputs("big_config", seed, device)
    for which in ("forward", "dq", "dkdv"):
        error = check(x, which, [], 2e-2)["against_float64"]["triton"]
        if not error <= ATTENTION_TOLERANCE:
            raise SystemExit(
                f"attention {which}: {error:.3g} from float64 (limit {ATTENTION_TOLERANCE}), refusing to measure it"
            )
    case = x["case"]
    forward_flops = 2.0 * case.heads * 2 * case.dim * x["squares"] / 2
    out = {"forward": (torch.empty_like(x["q"]),), "dq": (torch.empty_like(x["q"]),),
           "dkdv": (torch.empty_like(x["k"]), torch.empty_like(x["v"]))}  # fmt: skip
    kernels = {f"attention_{w}": Kernel(lambda w=w: triton_pass(x, w, out[w]), forward_flops * MMAS[w] / 2)
               for w in ("forward", "dq", "dkdv")}  # fmt: skip
    if configs:
        kernels.update(attention_configs(x, forward_flops, out))
    kernels.update(attention_backwards(x, forward_flops))
    kernels.update(attention_forward_fp8(x, forward_flops, out["forward"][0]))
    return kernels, int(x["q"].shape[0])


def _config_name(config: tuple[int, ...]) -> str:
    return "x".join(map(str, config))


def attention_configs(x: dict[str, Any], forward_flops: float, out: dict[str, tuple[torch.Tensor, ...]], *,
                      tables: dict[str, list[tuple[int, ...]]] | None = None, dkdv: bool = True) -> dict[str, Kernel]:  # fmt: skip
    """Every candidate config of each attention pass, pinned: ``attention_forward@BMxBNxWxSxP`` and
    ``attention_dq@...`` (the Triton passes' ``FORWARD_CONFIGS`` and ``DQ_CONFIGS``), ``attention_dkdv@NAME``
    (the Gluon pass's ``DKDV_CONFIGS``). The tuner picks by the time of short runs, where the card is not
    yet at its power cap; these rows give each config's energy at the cap. A pinned call puts the tuner's
    pick back as soon as it has launched, so no other row runs a pinned config. Each pinned config is
    checked against the tuned one's output first. ``tables`` replaces
    the Triton passes' candidates (the CPU test's, which the interpreter can run); ``dkdv=False`` leaves the
    Gluon pass out."""
    from gem_kernels import attention_gluon
    from gem_kernels import attention_triton as at

    tables = tables or {"forward": at.FORWARD_CONFIGS, "dq": at.DQ_CONFIGS}
    kernels: dict[str, Kernel] = {}
    picks = {}
    for which, tuned in (("forward", at.FORWARD), ("dq", at.DQ)):
        want = triton_pass(x, which)[0]  # tunes (if not yet), and names the key
        key, auto = tuned.last
        picks[which] = _config_name(auto)

        def pinned(config: tuple[int, ...], which: str = which, tuned: Any = tuned, key: tuple = key,
                   auto: tuple[int, ...] = auto) -> Any:  # fmt: skip
            tuned.chosen[key] = config  # read at launch, on the host; every other caller gets the tuner's pick
            try:
                return triton_pass(x, which, out[which])
            finally:
                tuned.chosen[key] = auto

        for config in tables[which]:
            _refuse_if_wrong(f"attention_{which}@{_config_name(config)}", pinned(config)[0], want,
                             ATTENTION_TOLERANCE, "the tuned config's output")  # fmt: skip
            kernels[f"attention_{which}@{_config_name(config)}"] = Kernel(
                lambda p=pinned, c=config: p(c), forward_flops * MMAS[which] / 2)
    want_dkdv = triton_pass(x, "dkdv") if dkdv else ()
    for name in attention_gluon.DKDV_CONFIGS if dkdv else ():
        got = gluon_pass(x, "dkdv", name, out["dkdv"])
        for a, b in zip(got, want_dkdv, strict=True):
            _refuse_if_wrong(f"attention_dkdv@{name}", a, b, ATTENTION_TOLERANCE, "the default config's output")
        kernels[f"attention_dkdv@{name}"] = Kernel(lambda n=name: gluon_pass(x, "dkdv", n, out["dkdv"]),
                                                   forward_flops * MMAS["dkdv"] / 2)  # fmt: skip
    print(f"tuner's picks on these inputs: {picks}; the dk/dv pass's default {attention_gluon.DEFAULT_DKDV_CONFIG}")
    return kernels


FP8_FORWARD_TOLERANCE = 0.1
"""The fp8 forward's largest relative error against the bf16 forward's output (``benchmarks/attention_fp8.py``'s
``--max-error``): e4m3 keeps 3 mantissa bits of ``q`` and ``k``."""


def attention_forward_fp8(x: dict[str, Any], forward_flops: float, out: torch.Tensor) -> dict[str, Kernel]:
    """The forward with ``q k^T`` in e4m3 (``fp8_forward``; ``q``, ``k`` cast per token and head before, as the
    fused gap's silu pass writes them, so not counted), checked against the bf16 forward first. Its FLOPs
    are the bf16 forward's: one of its two MMAs runs in e4m3."""
    from gem_kernels.attention_fp8 import quantize_qk
    from gem_kernels.attention_triton import query_major

    q8, k8, scales = quantize_qk(x["q"], x["k"])

    def call() -> tuple[torch.Tensor]:
        return (query_major(q8, k8, x["v"], None, x["offsets"], x["targets"], fp8_scales=scales, out=out,
                            **x["options"]),)  # fmt: skip

    _refuse_if_wrong("attention_forward_fp8", call()[0], triton_pass(x, "forward")[0], FP8_FORWARD_TOLERANCE,
                     "the bf16 forward's output")  # fmt: skip
    return {"attention_forward_fp8": Kernel(call, forward_flops)}


def attention_backwards(x: dict[str, Any], forward_flops: float) -> dict[str, Kernel]:
    """The whole attention backward three ways: as shipped (the ``dq`` pass, then the ``dk``/``dv`` pass: 7
    MMAs a pair), with ``dq`` added by atomics in the key-major pass (5 MMAs a pair, the float32 buffer's
    zeroing and cast included), and with ``dq`` from the ``ds`` tiles the ``dk``/``dv`` pass stores
    (``dq_mode="stored"``, :mod:`gem_kernels.attention_stored`: 5 MMAs a pair and ~2 bytes a pair each way,
    the buffer's allocation included); and the stored form's two passes alone. Each form's gradients are
    checked against the shipped ones first."""
    from gem_kernels.attention_stored import dq_from_stored, prepare
    from gem_kernels.attention_triton_autograd import attention_backward
    from gem_kernels.attention_triton_bias import NO_BIAS
    from gem_kernels.attention_triton_bwd import key_major

    options = x["options"]
    plan = prepare(x["offsets"], x["q"].shape[1])

    def backward(mode: str) -> tuple[torch.Tensor, ...]:
        dq, dk, dv, _, _ = attention_backward(
            x["grad_out"], x["q"], x["k"], x["v"], x["offsets"], x["targets"], NO_BIAS,
            max_seq_len=options["max_seq_len"], alpha=options["alpha"], max_attn_len=options["max_attn_len"],
            dq_mode=mode, blocks=None, needs_position=False, needs_time=False, score_plan=plan,
        )  # fmt: skip
        return dq, dk, dv

    shipped = backward("separate")
    for mode in ("atomic", "stored"):
        for name, a, b in zip(("dq", "dk", "dv"), backward(mode), shipped, strict=True):
            _refuse_if_wrong(f"attention_backward_{mode} ({name})", a, b, ATTENTION_TOLERANCE, "the shipped backward's")
    stored = plan.scores(x["q"].dtype)
    if stored is None:
        raise SystemExit("attention_backward_stored: the ds buffer passes attention_stored.BUDGET_BYTES")
    dk, dv, dq = torch.empty_like(x["k"]), torch.empty_like(x["v"]), torch.empty_like(x["q"])
    kernel_args = (x["q"], x["k"], x["v"], x["grad_out"], x["offsets"], x["targets"], None)
    key_options = {k: options[k] for k in ("max_seq_len", "alpha", "max_attn_len")}

    def dkdv_stored() -> tuple[torch.Tensor, torch.Tensor]:
        return key_major(*kernel_args, out=(dk, dv), stored=stored, **key_options)

    def dq_stored() -> torch.Tensor:
        return dq_from_stored(stored, x["k"], x["offsets"], x["targets"], max_seq_len=options["max_seq_len"],
                              alpha=options["alpha"], out=dq)  # fmt: skip

    dkdv_stored()
    _refuse_if_wrong("attention_dq_stored", dq_stored(), shipped[0], ATTENTION_TOLERANCE, "the shipped backward's dq")
    return {
        "attention_backward": Kernel(lambda: backward("separate"), forward_flops * 7 / 2),
        "attention_backward_atomic": Kernel(lambda: backward("atomic"), forward_flops * 5 / 2),
        "attention_backward_stored": Kernel(lambda: backward("stored"), forward_flops * 5 / 2),
        "attention_dkdv_stored": Kernel(dkdv_stored, forward_flops * 4 / 2),
        "attention_dq_stored": Kernel(dq_stored, forward_flops / 2),
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
