"""gem-precision on one GPU: MX quantize bandwidth, MXFP8 GEMM, fp8 linears, activation memory.

    python benchmarks/precision.py --out results/precision.json [--quick] [--sections a,b]

Sections (each checks correctness on random data before it times anything, and a failing section
is recorded and does not stop the others): mx_quant, mx_gemm, fp8_linear, activation. Times are
medians of ``triton.testing.do_bench`` (L2 flushed between runs). ``--smoke`` runs every section on
CPU under TRITON_INTERPRET=1 with tiny shapes, to check the script itself (timings meaningless).
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
from torch import nn

Row = dict[str, Any]
SECTIONS = ("mx_quant", "mx_gemm", "fp8_linear", "activation")


class Bench:
    """Shapes and timer for one run: full (H200), --quick, or --smoke (CPU, interpreter)."""

    def __init__(self, quick: bool, smoke: bool):
        self.quick, self.smoke = quick, smoke
        self.device = torch.device("cpu" if smoke else "cuda")

    def size(self, full: Any, quick: Any, smoke: Any) -> Any:
        return smoke if self.smoke else quick if self.quick else full

    def ms(self, fn: Callable[[], Any], grad_to_none: list[torch.Tensor] | None = None) -> float:
        if self.smoke:
            times = []
            for _ in range(3):
                for t in grad_to_none or []:
                    t.grad = None
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            return sorted(times)[1]
        import triton.testing

        return float(triton.testing.do_bench(fn, grad_to_none=grad_to_none, return_mode="median"))

    def randn(self, *shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
        gen = torch.Generator(device=self.device).manual_seed(seed)
        return torch.randn(*shape, generator=gen, device=self.device, dtype=torch.float32).to(dtype)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(f"correctness check failed, not timing: {what}")


# ---------------------------------------------------------------------------------------- sections


# tiles swept per mode: (BLOCK_R, BLOCK_C, num_warps) of the 4-d kernel, or (0, BLOCK_C, column
# tiles per program) of the one-warp column kernel (mx_triton.Tile)
MX_TILES = {
    "rows": [(32, 128, 4), (64, 128, 4), (64, 256, 8), (128, 128, 8), (32, 256, 8), (32, 512, 8), (64, 256, 4),
             (32, 512, 4), (64, 512, 8)],
    "cols_t": [(32, 128, 4), (64, 128, 4), (128, 64, 8), (0, 32, 1), (0, 32, 2), (0, 32, 4), (0, 64, 1), (0, 64, 2)],
    "both": [(32, 128, 4), (64, 128, 8), (32, 64, 4), (0, 32, 1), (0, 32, 2), (0, 64, 1)],
}  # fmt: skip


def mx_quant(b: Bench) -> list[Row]:
    from gem_precision.checks import check_mx_quantization, summarize
    from gem_precision.mx_triton import mx_dequantize_triton, mx_quantize_triton
    from gem_precision.testing import mx_edge_cases

    r, c = b.size((16384, 8192), (8192, 4096), (64, 96))
    x = b.randn(r, c)
    cases = {"x": x, **{name: t.to(b.device) for name, t in mx_edge_cases().items()}}
    checks: Row = {}
    for sw in (False, True):  # the interpreter's own fp8 cast is not RNE: only software rounding there
        diffs = [] if (b.smoke and not sw) else check_mx_quantization(cases, software_round=sw)
        checks["software_round" if sw else "hardware_cast"] = "n/a (interpreter)" if b.smoke and not sw else not diffs
        if diffs:
            print(f"mx_quant: default tiles differ from the reference (software_round={sw}):\n{summarize(diffs)}")
    rows: list[Row] = []
    scale_bytes = r * -(-c // 32)
    for mode, want_rows, want_cols in (("rows", True, False), ("cols_t", False, True), ("both", True, True)):
        written = (r * c + scale_bytes) * (int(want_rows) + int(want_cols))
        best: Row | None = None
        for tile in [None, *([] if b.smoke else MX_TILES[mode])]:
            kw = {"rows": want_rows, "cols_t": want_cols, "tile": tile}
            row: Row = {"mode": mode, "shape": [r, c], "tile": tile or "default"}
            try:  # a candidate counts only if it compiles, runs and gives the reference's bits
                diffs = check_mx_quantization(
                    {"x": x}, software_round=b.smoke, rows=want_rows, cols_t=want_cols, tile=tile
                )
            except Exception as exc:  # recorded on the row; the sweep goes on
                rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            ms = b.ms(lambda kw=kw: mx_quantize_triton(x, **kw))
            row.update({"ms": ms, "TB/s": (x.numel() * 2 + written) / ms / 1e9, "target TB/s": 3.4,
                        "bit_exact": not diffs})  # fmt: skip
            rows.append(row)
            if not diffs and (best is None or ms < best["ms"]):
                best = row
        if best is not None:
            rows.append({**best, "tile": f"best={best['tile']}", "meets target": best["TB/s"] >= 3.4})
    mx = mx_quantize_triton(x)[0]
    ms = b.ms(lambda: mx_dequantize_triton(mx, torch.bfloat16))
    rows.append({"mode": "dequantize->bf16", "shape": [r, c], "ms": ms, "TB/s": (r * c * 3 + scale_bytes) / ms / 1e9})
    rows[0]["bit_exact (default tiles, edge cases)"] = checks
    return rows


def mx_gemm(b: Bench) -> list[Row]:
    shapes = b.size(
        [(8192, 8192, 8192), (65536, 512, 512), (65536, 1024, 1024), (65536, 2048, 2048)],
        [(4096, 4096, 4096), (16384, 1024, 1024)],
        [(64, 32, 96)],
    )
    rows = [_mx_gemm_shape(b, m, n, k) for m, n, k in shapes]
    return rows + ([] if b.smoke else _mx_gemm_variants(b, *shapes[0]))


def _mx_gemm_variants(b: Bench, m: int, n: int, k: int) -> list[Row]:
    """Each autotune config timed alone; the best of each variant (fp8 fold, bf16 dequant) with its error."""
    from gem_precision import mx_gemm as mg
    from gem_precision.mx_reference import mx_gemm_reference
    from gem_precision.mx_triton import mx_quantize_triton

    a, bq = mx_quantize_triton(b.randn(m, k, seed=1))[0], mx_quantize_triton(b.randn(n, k, seed=2))[0]
    want, best = mx_gemm_reference(a, bq), {}
    for cfg in mg._configs():
        conf = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        ms = b.ms(lambda conf=conf: mg.mx_gemm_triton(a, bq, config=conf))
        if cfg.kwargs["DEQUANT"] not in best or ms < best[cfg.kwargs["DEQUANT"]][0]:
            best[cfg.kwargs["DEQUANT"]] = (ms, conf)
    return [{"M": m, "N": n, "K": k, "variant": ("fp8 fold", "bf16 dequant")[dq], "triton config": str(conf),
             "triton TFLOP/s": 2.0 * m * n * k / ms / 1e9,
             "rel_err": rel(mg.mx_gemm_triton(a, bq, out_dtype=torch.float32, config=conf), want)}
            for dq, (ms, conf) in sorted(best.items())]  # fmt: skip


def _mx_gemm_shape(b: Bench, m: int, n: int, k: int) -> Row:
    from gem_precision import mx_gemm as mg
    from gem_precision.device import MX_NATIVE_MIN_CAPABILITY, has_capability
    from gem_precision.mx_reference import mx_gemm_reference
    from gem_precision.mx_triton import mx_dequantize_triton, mx_quantize_triton

    a_hp, b_hp = b.randn(m, k, seed=1), b.randn(n, k, seed=2)
    a, bq = mx_quantize_triton(a_hp)[0], mx_quantize_triton(b_hp)[0]
    assert a is not None and bq is not None
    want = mx_gemm_reference(a, bq)  # float32 matmul of the dequantized operands (no TF32)
    err = rel(mg.mx_gemm_triton(a, bq, out_dtype=torch.float32), want)
    require(err < 1e-3, f"Triton MX GEMM {m}x{n}x{k}: relative error {err:.2e}")
    del want
    flop = 2.0 * m * n * k
    t_mx = b.ms(lambda: mg.mx_gemm_triton(a, bq))
    t_bf16 = b.ms(lambda: a_hp @ b_hp.t())
    t_emu = b.ms(lambda: mx_dequantize_triton(a, torch.bfloat16) @ mx_dequantize_triton(bq, torch.bfloat16).t())
    row: Row = {"M": m, "N": n, "K": k, "rel_err": err, "rel_err < 1e-5": err < 1e-5,
                "triton TFLOP/s": flop / t_mx / 1e9, "bf16 mm TFLOP/s": flop / t_bf16 / 1e9,
                "emulated TFLOP/s": flop / t_emu / 1e9, "vs bf16": t_bf16 / t_mx, "vs emulated": t_emu / t_mx,
                "targets": ">= 1.0x bf16 (8192^3), >= 2x emulated"}  # fmt: skip
    if not b.smoke:
        row["triton config"] = str(getattr(mg._mx_gemm_tuned, "best_config", None))
    if has_capability(b.device, MX_NATIVE_MIN_CAPABILITY):
        problem = mg.native_mx_probe(b.device.index or 0)
        if problem is None:
            row["native TFLOP/s"] = flop / b.ms(lambda: mg.mx_gemm_native(a, bq)) / 1e9
        row["native"] = problem or "ok"
    return row


def fp8_linear(b: Bench) -> list[Row]:
    from gem_precision.checks import check_fp8_quantization, summarize
    from gem_precision.formats import E4M3
    from gem_precision.fp8_quant_triton import quantize_fp8_triton
    from gem_precision.schemes import Fp8RowwiseScheme, Fp8TensorwiseScheme, MXFP8Scheme
    from gem_precision.testing import mx_edge_cases

    m, k, n = b.size((65536, 4096, 4096), (16384, 2048, 2048), (64, 64, 32))
    x, gy = b.randn(m, k, seed=3), b.randn(m, n, seed=4)
    # the fused quantization, bit for bit, on random data and on the edge cases; a mismatch is
    # reported in detail (and in the JSON) and marks the rows, but the timings still run
    cases = {"x": x, **{name: e.to(b.device) for name, e in mx_edge_cases().items() if e.shape[0] > 1}}
    diffs = check_fp8_quantization(cases, software_round=None)
    if diffs:
        print(f"fp8_linear: fused fp8 quantization differs from the reference:\n{summarize(diffs)}")
    rows: list[Row] = [{"what": "fused fp8 quantization vs reference", "bit_exact": not diffs,
                        "mismatching tensors": len(diffs), "_diagnostics": diffs}]  # fmt: skip
    torch.manual_seed(0)
    master = nn.Linear(k, n).to(b.device)
    bf16 = copy.deepcopy(master).to(torch.bfloat16)

    def step(module: nn.Module, inp: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = module(inp)
        y.backward(gy)
        return y, inp.grad, module.weight.grad

    def train_ms(module: nn.Module) -> float:
        inp = x.detach().clone().requires_grad_(True)
        return b.ms(lambda: step(module, inp), grad_to_none=[inp, *module.parameters()])

    t_bf16 = train_ms(bf16)
    ref = step(copy.deepcopy(bf16), x.detach().clone().requires_grad_(True))
    rows.append({"what": "bf16 nn.Linear fwd+bwd", "shape": [m, k, n], "ms": t_bf16})
    native = "emulated" if b.smoke else "native"
    for cls, backend in ((Fp8RowwiseScheme, native), (Fp8TensorwiseScheme, native), (MXFP8Scheme, "auto")):
        fast = cls(cls.Config(backend=backend)).convert_linear(copy.deepcopy(master), "bench")
        slow = cls(cls.Config(backend="emulated")).convert_linear(copy.deepcopy(master), "bench")
        got = step(fast, x.detach().clone().requires_grad_(True))
        emu = step(slow, x.detach().clone().requires_grad_(True))
        errs = [rel(g, e) for g, e in zip(got, emu)]
        vs_bf16 = [rel(g, r) for g, r in zip(got, ref)]
        del got, emu
        # out of tolerance is recorded on the row, not fatal: the time is still worth having
        ok = max(errs) < 2e-2 and max(vs_bf16) < 0.15
        ms = train_ms(fast)
        rows.append({"what": f"{cls.name} fwd+bwd (incl. quantization)", "shape": [m, k, n], "ms": ms,
                     "speedup vs bf16": t_bf16 / ms, "target": ">= 1.3x (fp8_rowwise)" if cls is Fp8RowwiseScheme else "",
                     "rel_err vs emulated": max(errs), "rel_err vs bf16": max(vs_bf16), "within tolerance": ok,
                     "quantization bit-exact": not diffs if cls is not MXFP8Scheme else ""})  # fmt: skip
    if not b.smoke:  # where the time goes: fused quantization alone, and the three GEMMs alone
        for gran in ("row", "tensor"):
            ms = b.ms(lambda gran=gran: quantize_fp8_triton(x, granularity=gran, fmt=E4M3, cols_t=True, pad_to=16))
            rows.append({"what": f"quantize x {gran} (rows + cols_t)", "ms": ms, "TB/s": x.numel() * 4 / ms / 1e9})
            ms = b.ms(
                lambda gran=gran: quantize_fp8_triton(
                    gy, granularity=gran, fmt=E4M3, cols_t=True, col_sum=True, pad_to=16
                )
            )
            rows.append({"what": f"quantize grad {gran} (rows + cols_t + bias grad)", "ms": ms})
        xq = quantize_fp8_triton(x, granularity="row", fmt=E4M3, cols_t=True, pad_to=16)
        wq = quantize_fp8_triton(master.weight.detach(), granularity="row", fmt=E4M3, cols_t=True, pad_to=16)
        gq = quantize_fp8_triton(gy, granularity="row", fmt=E4M3, cols_t=True, pad_to=16)

        def gemms() -> None:
            for p, q in ((xq.rows, wq.rows), (gq.rows, wq.cols_t), (gq.cols_t, xq.cols_t)):
                torch._scaled_mm(
                    p.data, q.data.t(), scale_a=p.scale_inv, scale_b=q.scale_inv.view(1, -1), out_dtype=torch.bfloat16
                )

        rows.append({"what": "three rowwise _scaled_mm GEMMs alone", "ms": b.ms(gemms)})
    return rows


def activation(b: Bench) -> list[Row]:
    from gem_precision import activation as act
    from gem_precision.testing import HstuLikeBlock

    tokens, dim = b.size((1 << 20, 512), (1 << 18, 512), (256, 64))
    torch.manual_seed(0)
    base = HstuLikeBlock(dim).to(b.device, torch.bfloat16)
    x0, gy = b.randn(tokens, dim, seed=5), b.randn(tokens, dim, seed=6)
    small = {"min_numel": 1024} if b.smoke else {}
    fp8 = act.Fp8SavedPolicy
    policies = {"none": act.NoActivationPolicy(), "fp8_saved": fp8(fp8.Config(**small)),
                "fp8_saved(row)": fp8(fp8.Config(granularity="row", **small)),
                "checkpoint_selective": act.CheckpointSelectivePolicy(), "checkpoint_full": act.CheckpointFullPolicy()}  # fmt: skip

    def forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # stands in for the previous block's output: only what this block saves keeps it alive
        return block(x * 1.0)

    def run(block: nn.Module) -> list[torch.Tensor]:
        x = x0.detach().clone().requires_grad_(True)
        forward(block, x).backward(gy)
        out = [x.grad, *(p.grad for p in block.parameters())]
        block.zero_grad(set_to_none=True)
        return out

    rows: list[Row] = []
    want = run(base)
    for name, policy in policies.items():
        block = policy.wrap_block(copy.deepcopy(base), "blocks.0")
        got = run(block)
        errs = [rel(g, w) for g, w in zip(got, want)]
        limit = (0.05, 0.15) if name.startswith("fp8") else (1e-3, 1e-3)
        require(errs[0] < limit[0] and max(errs[1:]) < limit[1], f"{name}: gradient errors {errs}")
        del got
        row: Row = {"policy": name, "tokens": tokens, "dim": dim, "grad rel_err (x, max param)": [errs[0], max(errs[1:])]}  # fmt: skip
        x = x0.detach().clone().requires_grad_(True)
        if b.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            y = forward(block, x)
            row["saved GiB"] = (torch.cuda.memory_allocated() - start - y.numel() * y.element_size()) / 2**30
            y.backward(gy)
            row["peak GiB"] = (torch.cuda.max_memory_allocated() - start) / 2**30
            del y
        block.zero_grad(set_to_none=True)
        if isinstance(policy, fp8):
            policy.reset_stats()
            forward(block, x)
            s = policy.stats
            row["fp8 stats: compressed, in GiB, stored GiB"] = [s.compressed, s.bytes_in / 2**30, s.bytes_stored / 2**30]  # fmt: skip
        row["step ms"] = b.ms(
            lambda block=block, x=x: forward(block, x).backward(gy), grad_to_none=[x, *block.parameters()]
        )
        rows.append(row)
    none = rows[0]
    for row in rows[1:]:
        row["step cost vs none"] = row["step ms"] / none["step ms"] - 1
        if "saved GiB" in row:
            row["saved reduction"] = 1 - row["saved GiB"] / none["saved GiB"]
            row["peak reduction"] = 1 - row["peak GiB"] / none["peak GiB"]
    rows.append({"policy": "targets (fp8_saved)", "saved reduction": ">= 0.45", "peak reduction": ">= 0.30",
                 "step cost vs none": "<= 0.05"})  # fmt: skip
    return rows


# ------------------------------------------------------------------------------------------ driver


def meta(args: argparse.Namespace, device: torch.device) -> Row:
    info: Row = {"date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "command": " ".join([sys.executable, *sys.argv]),
                 "python": platform.python_version(), "torch": torch.__version__, "device": str(device)}  # fmt: skip
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = f"not importable: {exc}"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["capability"] = list(torch.cuda.get_device_capability(device))
        info["cuda"] = torch.version.cuda
    try:
        from gem_precision import __version__

        info["gem_precision"] = __version__
    except ImportError as exc:
        info["gem_precision"] = f"not importable: {exc}"
    return info


def print_table(name: str, rows: list[Row]) -> None:
    print(f"\n== {name}")
    keys = [k for k in dict.fromkeys(k for row in rows for k in row) if not k.startswith("_")]  # _: JSON only
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
    widths = {k: max(len(k), *(len(fmt(row.get(k, ""))) for row in rows)) for k in keys}
    print("  ".join(k.ljust(widths[k]) for k in keys))
    for row in rows:
        print("  ".join(fmt(row.get(k, "")).ljust(widths[k]) for k in keys))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="write the results as JSON to this path")
    parser.add_argument("--quick", action="store_true", help="smaller shapes (minutes less)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {list(SECTIONS)}")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: this benchmark is for a GPU (use --smoke to check the script on CPU)")
    bench = Bench(args.quick, args.smoke)
    results: Row = {"meta": meta(args, bench.device), "sections": {}}
    functions = {"mx_quant": mx_quant, "mx_gemm": mx_gemm, "fp8_linear": fp8_linear, "activation": activation}
    for name in chosen:
        start = time.perf_counter()
        try:
            rows, error = functions[name](bench), None
        except Exception as exc:  # one failing section must not lose the others' results
            rows, error = [], f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        if bench.device.type == "cuda":
            torch.cuda.empty_cache()
        results["sections"][name] = {"rows": rows, "error": error, "seconds": time.perf_counter() - start}
        print_table(name, rows) if rows else print(f"\n== {name}\nFAILED: {error}")
        if args.out:  # written after every section, so a later crash keeps what was measured
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(results, f, indent=2, default=str)
    return 1 if any(s["error"] for s in results["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
