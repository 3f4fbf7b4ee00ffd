"""The compiled (GPU) path, which the interpreter never runs: compile every kernel for sm_90 on CPU,
without and with the relative biases, the fused block's producers writing e4m3 rows, and the fused
gap's own kernels as their launchers configure them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

GROUPS = {
    "plain": """[Variant(k, "bfloat16", 128, 128, targets=True, window=True)
             for k in ("forward", "dq", "dkdv", "dkdv_atomic")]
            + [Variant(k, "float16", 25, 16, targets=False) for k in ("forward", "dkdv_atomic")]""",
    # the relative biases: inline-PTX table loads, the diagonal gather and the bucket atomics
    "biases": """[Variant(k, "bfloat16", 128, 128, targets=True, window=True, position_bias=True, time_bias=True)
             for k in ("forward", "dq", "dkdv", "dkdv_atomic")]""",
    # the inner loops' tiles by tensor descriptors (TMA): on by default in the forward and the dq pass
    "tma": """[Variant(k, "bfloat16", 128, 128, targets=True, window=True, tma=True) for k in ("forward", "dq", "dkdv")]""",
    # the forward's e4m3 q k^T (fp8_forward): the fp8 wgmma, with and without the biases
    "fp8": """[Variant("forward", "bfloat16", 128, 128, targets=True, window=True, fp8=True),
            Variant("forward", "bfloat16", 128, 128, targets=True, window=True, position_bias=True, time_bias=True,
                    fp8=True)]""",
}
SCRIPT = """
import json
from gem_kernels.compile_report import Variant, compile_producer, compile_variant, configs
for v in ({variants}):
    r = compile_variant(v, configs(v.kernel, wide=False)[0])
    print(json.dumps({{"kernel": v.kernel, "dtype": v.dtype, "shared": r["shared_bytes"], "registers": r["registers"],
                      "fp8_mma": r["fp8_mma"], "tma": r["tma_loads"]}}))
for kernel, quantize, columns, keep_x, words in ({producers}):  # the fused block's layer norm and norm-gate, writing e4m3 rows
    r = compile_producer(kernel, quantize=quantize, column_amax=columns, keep_x=keep_x, words=words)
    print(json.dumps({{"kernel": kernel, "shared": r["shared_bytes"], "registers": r["registers"],
                      "barriers": r["barriers"], "keep_x": keep_x, "words": words,
                      "narrow": r["narrow_loads"] + r["narrow_stores"]}}))
"""
# (kernel, e4m3 rows of its output, column maxima, e4m3 rows of its input: fp8_saved's kept attention output,
# rows stored as 16-bit words)
PRODUCERS = {"plain": '[("norm", True, False, False, False), ("norm", True, True, False, False), '
                      '("norm_gate", True, True, False, False), ("norm_gate", False, False, True, False), '
                      '("norm_gate", False, False, True, True)]', "biases": "[]", "tma": "[]", "fp8": "[]"}
HOPPER_SHARED_LIMIT = 227 * 1024
COUNTS = {"plain": 11, "biases": 4, "tma": 3, "fp8": 2}


@pytest.mark.parametrize("group", list(GROUPS))
def test_kernels_compile_for_hopper(group: str) -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    script = SCRIPT.format(variants=GROUPS[group], producers=PRODUCERS[group])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == COUNTS[group]
    for report in reports:
        assert report["shared"] <= HOPPER_SHARED_LIMIT, report
        assert report["registers"] is not None, report
        assert report.get("fp8_mma", False) == (group == "fp8"), report  # e4m3 wgmma exactly where asked
        assert report.get("tma", False) == (group == "tma"), report  # bulk tensor copies exactly where asked
    for report in reports:  # rows read and written in 16-byte vectors (a 2-byte access is a row not vectorized)
        assert report.get("narrow", 0) == 0, report
    keep_x = {r["words"]: r["barriers"] for r in reports if r.get("keep_x")}
    if keep_x:  # the norm-gate's rows of its input as words: the tile keeps its layout, fewer CTA barriers
        assert keep_x[True] < keep_x[False], keep_x


GAP_SCRIPT = """
import json
from gem_kernels import attention_fp8 as fp8, hstu_gap_grad_rows as grad_rows, hstu_gap_saved as saved, hstu_gap_triton as gap
from gem_kernels import norm_gate_triton as ng
from gem_kernels.compile_report import compile_kernel

rows = {"PRE": "*bf16", "POST": "*bf16", "Q": "*u8", "SCALE_INV": "*fp32"}
kernels = {
    # a 4096-wide row (the big config) in registers, one row a program, 4 warps: silu_quantize_rows' choice
    "silu_quantize": (saved._silu_quantize, rows, dict(ROWS=1, BLOCK=4096, ONE_CHUNK=True), 4),
    "silu_quantize_chunks": (saved._silu_quantize, rows, dict(ROWS=1, BLOCK=4096, ONE_CHUNK=False), 4),
    # 32 values a thread (the tile shipped until 2026-12-05)
    "expand": (saved._expand, {"Q": "*u8", "SCALE_INV": "*fp32", "U": "*bf16", "POST": "*bf16"},
               dict(ROWS=16, COLS=256), 4),
    # a tile of 8 values a thread (saved.EXPAND_TILE): the bytes are loaded in the 16-bit stores' layout
    "expand_narrow": (saved._expand, {"Q": "*u8", "SCALE_INV": "*fp32", "U": "*bf16", "POST": "*bf16"},
                      dict(ROWS=4, COLS=256), 4),
    "silu_grad_e4m3": (gap._silu_columns, {"X": "*bf16", "PRE": "*u8", "SCALE_INV": "*fp32", "OUT": "*bf16"},
                       dict(GRAD=True, E4M3=True, ROWS=16, COLS=256), 4),
    "silu": (gap._silu_columns, {"X": "*bf16", "PRE": "*bf16", "SCALE_INV": "*bf16", "OUT": "*bf16"},
             dict(GRAD=False, E4M3=False, ROWS=16, COLS=256), 4),
    # fp8_forward's silu pass of q, k writing their e4m3 copies and scales (attention_fp8)
    "silu_quantize_qk": (fp8._quantize_heads, {"X": "*bf16", "POST": "*bf16", "DATA": "*u8", "SCALES": "*fp32"},
                         dict(D=128, BLOCK_D=128, ROWS=fp8.ROWS, SILU=True), 4),
    # the pipelined loops (tl.range num_stages, which the interpreter ignores), as their launchers set them
    "norm_gate_bwd": (ng._norm_gate_bwd, dict.fromkeys(("X", "U", "DY", "DX", "DU"), "*bf16")
                      | dict.fromkeys(("W", "B", "MEAN", "RSTD", "DW_PART", "DB_PART", "X_INV", "U_INV", "DU_SUM_PART"), "*fp32"),
                      dict(D=1024, BLOCK_D=1024, ROWS=4, SILU_GATE=True, X_E4M3=False, U_E4M3=False,
                           DU_SUMS=False, STAGES=ng.PIPELINE_STAGES), 4),
    # fp8_saved's rows read in the loop as 16-bit words (gap.E4M3_ROWS_IN_NORM_GATE)
    "norm_gate_bwd_e4m3": (ng._norm_gate_bwd, dict.fromkeys(("DY", "DX", "DU"), "*bf16") | dict.fromkeys(("X", "U"), "*i16")
                           | dict.fromkeys(("W", "B", "MEAN", "RSTD", "DW_PART", "DB_PART", "X_INV", "U_INV", "DU_SUM_PART"), "*fp32"),
                           dict(D=1024, BLOCK_D=1024, ROWS=4, SILU_GATE=True, X_E4M3=True, U_E4M3=True,
                                DU_SUMS=False, STAGES=ng.PIPELINE_STAGES), 4),
    # the bf16 step's: the norm-gate backward also sums the u columns, the last pass reads only v, q, k
    # (gap.U_SUMS_IN_NORM_GATE)
    "norm_gate_bwd_du_sums": (ng._norm_gate_bwd, dict.fromkeys(("X", "U", "DY", "DX", "DU"), "*bf16")
                              | dict.fromkeys(("W", "B", "MEAN", "RSTD", "DW_PART", "DB_PART", "X_INV", "U_INV",
                                               "DU_SUM_PART"), "*fp32"),
                              dict(D=1024, BLOCK_D=1024, ROWS=4, SILU_GATE=True, X_E4M3=False, U_E4M3=False,
                                   DU_SUMS=True, STAGES=ng.PIPELINE_STAGES), 4),
    "silu_grad_rows_u_summed": (grad_rows._silu_grad_rows, {"D_PRE": "*bf16", "PRE": "*bf16", "SCALE_INV": "*bf16",
                                "DQ": "*bf16", "Q": "*fp32", "Q_INV": "*fp32", "SUMS": "*fp32"},
                                dict(W=4096, BLOCK_W=4096, ROWS=1, HAS_DQ=False, E4M3=False, ROWS_OUT=False,
                                     COL_SUM=True, U_SUMMED=True, STAGES=grad_rows.PIPELINE_STAGES),
                                grad_rows.WARPS_SUMS_ONLY),
    "silu_grad_rows": (grad_rows._silu_grad_rows, {"D_PRE": "*bf16", "PRE": "*bf16", "SCALE_INV": "*bf16", "DQ": "*bf16",
                       "Q": "*u8", "Q_INV": "*fp32", "SUMS": "*fp32"},
                       dict(W=4096, BLOCK_W=4096, ROWS=1, HAS_DQ=False, E4M3=False, ROWS_OUT=True, COL_SUM=True, U_SUMMED=False,
                            STAGES=grad_rows.PIPELINE_STAGES), 8),
}
for name, (fn, pointers, constants, warps) in kernels.items():
    constants = {**constants, "INTERP": False}
    signature = {n: pointers.get(n, "i32") for n in fn.arg_names if n not in constants}
    # the model's widths are multiples of 16 (the big config's hv = 1024, W = 4096), as the JIT sees them
    divisible = ("width", "hv", "num_cols", "first_col")
    print(json.dumps({"kernel": name, **compile_kernel(fn, signature, constants, warps, divisible=divisible)}))
"""


def test_the_gap_kernels_compile_for_hopper_without_spills() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", GAP_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = {r["kernel"]: r for r in (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{"))}
    assert len(reports) == 12
    for name, report in reports.items():
        # the norm-gate backward's fastest launch on the H200 (4 rows, 4 warps, 3 stages) spills 8 bytes, with
        # its rows read as e4m3 words too
        spill = 8 if name.startswith("norm_gate_bwd") else 0
        assert report["registers"] is not None and report["stack_bytes"] <= spill, report
    # the e4m3 rows read as words keep the 16-bit tiles' layout: no conversion through shared memory
    # (read as bytes, the loop had 53 CTA barriers against 15)
    assert reports["norm_gate_bwd_e4m3"]["barriers"] <= reports["norm_gate_bwd"]["barriers"]
    # every load and store in 16-byte (or at least 4-byte) vectors: fp8_saved's silu pass picked post's
    # columns with tl.where and stored them 2 bytes at a time (32 st.global.b16 a thread; now plain offsets)
    for name, report in reports.items():
        assert report["narrow_loads"] == 0 and report["narrow_stores"] == 0, (name, report)
    # the expansion's 16 x 256 tile converts its bytes' layout through shared memory; 4 x 256 (shipped,
    # saved.EXPAND_TILE: 1.31x on the H200) needs no conversion
    assert reports["expand"]["barriers"] > 0 and reports["expand_narrow"]["barriers"] == 0, (
        reports["expand"], reports["expand_narrow"])
    # the e4m3 rows are cast by the hardware, round to nearest even, as gem-precision's reference
    assert reports["silu_quantize"]["rne_fp8_cast"] and reports["silu_quantize_chunks"]["rne_fp8_cast"]
    assert reports["silu_quantize_qk"]["rne_fp8_cast"]
