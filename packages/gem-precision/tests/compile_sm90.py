"""Compile one variant of every Triton kernel for sm_90 (Hopper), with no GPU: a script, run by
test_compile_sm90.py in a process without TRITON_INTERPRET (the interpreter never compiles).

Catches what the interpreter cannot: type errors of the compiled frontend, layouts that do not
lower, register spills, and fp8 casts that are not the hardware's round-to-nearest-even.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gem_precision import fp8_blocks_triton, fp8_quant_triton, fp8_rows_triton, mx_gemm, mx_triton
from gem_precision.formats import E4M3
from gem_precision.triton_common import fp8_kernel_constants

PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def spills(ptx: str) -> int | None:
    """Bytes of register spill stores reported by ptxas, or None when ptxas is not bundled."""
    if not os.path.exists(PTXAS):
        return None
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([PTXAS, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    found = re.findall(r"(\d+) bytes spill stores", out.stderr)
    return sum(int(v) for v in found) if found else None


def build(fn, sig: dict[str, str], consts: dict[str, object], warps: int, stages: int = 3) -> dict[str, object]:
    # the JIT specializes pointers and ints divisible by 16; so do we (it decides vector widths)
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in sig}
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = kernel.asm["ptx"]
    return {"spills": spills(ptx), "rne_cast": "cvt.rn.satfinite" in ptx, "wgmma": "wgmma" in ptx}


def main() -> None:
    u8, i32, f32 = "*u8", "i32", "*fp32"
    br, bc, w = mx_triton._default_tile(True, True)
    t = fp8_quant_triton._tiles()
    amax = {"row_amax_ptr": "*i32", "col_amax_ptr": "*i32", "tensor_amax_ptr": "*i32"}
    cfg = mx_gemm._configs()[0]
    cfg16 = next(c for c in mx_gemm._configs() if c.kwargs["DEQUANT"])  # the bf16-dequant variant
    report = {}
    report["mx_quantize"] = build(
        mx_triton._mx_quantize_kernel,
        {"x_ptr": "*bf16", "R": i32, "C": i32, "stride_xr": i32, "q_ptr": u8, "s_ptr": u8, "ld_s": i32,
         "qt_ptr": u8, "st_ptr": u8, "ld_st": i32},
        {"ROWS": True, "COLS_T": True, "SOFTWARE_ROUND": False, "BLOCK_R": br, "BLOCK_C": bc},
        w,
    )  # fmt: skip
    report["mx_quantize_cols"] = build(
        mx_triton._mx_quantize_cols_kernel,
        {"x_ptr": "*bf16", "R": i32, "C": i32, "stride_xr": i32, "q_ptr": u8, "s_ptr": u8, "ld_s": i32,
         "qt_ptr": u8, "st_ptr": u8, "ld_st": i32},
        {"ROWS": False, "SOFTWARE_ROUND": False, "BLOCK_C": 32, "NB": 2, "PACK_WORDS": True},
        1,
    )  # fmt: skip
    elements, rows_warps = fp8_rows_triton.ONE_PASS_TILE  # a 4096-wide gradient with its column sums
    report["fp8_rows"] = build(
        fp8_rows_triton._fp8_rows_kernel,
        {"x_ptr": "*bf16", "M": i32, "N": i32, "stride_xm": i32, "q_ptr": u8, "q_inv_ptr": f32, "col_sum_ptr": f32},
        {"COL_SUM": True, **fp8_kernel_constants(E4M3), "SOFTWARE_ROUND": False, "ROWS_PER_PROG": 128,
         "BLOCK_M": max(1, elements // 4096), "BLOCK_N": 4096, "ONE_CHUNK": True},
        rows_warps,
    )  # fmt: skip
    report["mx_dequantize"] = build(
        mx_triton._mx_dequantize_kernel,
        {"q_ptr": u8, "s_ptr": u8, "out_ptr": "*bf16", "R": i32, "C": i32, "ld_s": i32},
        {"BLOCK_R": 32, "BLOCK_C": 256},
        4,
    )
    report["fp8_stats"] = build(
        fp8_quant_triton._fp8_stats_kernel,
        {"x_ptr": "*bf16", "M": i32, "N": i32, "stride_xm": i32, "row_part_ptr": "*i32",
         "col_amax_ptr": "*i32", "tensor_amax_ptr": "*i32", "col_sum_ptr": f32},
        {"ROW": True, "COL": True, "TENSOR": False, "COL_SUM": True, "ROWS_PER_PROG": t["stats_rows"],
         "BLOCK_M": t["stats_m"], "BLOCK_N": t["stats_n"]},
        t["stats_warps"],
    )  # fmt: skip
    report["fp8_cast"] = build(
        fp8_quant_triton._fp8_cast_kernel,
        {"x_ptr": "*bf16", "M": i32, "N": i32, "stride_xm": i32, **amax, "q_ptr": u8, "q_inv_ptr": f32,
         "qt_ptr": u8, "qt_inv_ptr": f32, "M_PAD": i32},
        {"ROWS": True, "COLS_T": True, "TENSORWISE": False, **fp8_kernel_constants(E4M3), "SOFTWARE_ROUND": False,
         "BLOCK_M": t["cast_m"], "BLOCK_N": t["cast_n"]},
        t["warps"],
    )  # fmt: skip
    report["fp8_blocks_t"] = build(
        fp8_blocks_triton._fp8_blocks_t_kernel,
        {"x_ptr": "*bf16", "M": i32, "N": i32, "stride_xm": i32, "q_ptr": u8, "q_inv_ptr": f32, "M_PAD": i32},
        {"BLOCK": 128, "BLOCK_N": fp8_blocks_triton.TILE_N, **fp8_kernel_constants(E4M3), "SOFTWARE_ROUND": False},
        4,
    )  # fmt: skip
    mx_args = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "sa_t": f32, "sb_t": f32, "c_ptr": "*bf16", "bias_ptr": f32,
               "M": i32, "N": i32, "K": i32, "KB": i32, "stride_am": i32, "stride_bn": i32, "stride_cm": i32,
               "M_BUCKET": i32, "K_BUCKET": i32}  # fmt: skip
    for name, config in (("mx_gemm", cfg), ("mx_gemm_bf16", cfg16)):
        constexprs = {"HAS_BIAS": False, "EVEN_K": True, "F32_DOT": False, **config.kwargs}
        report[name] = build(mx_gemm._mx_gemm_kernel, mx_args, constexprs, config.num_warps, config.num_stages)
    json.dump(report, sys.stdout)


if __name__ == "__main__":
    main()
