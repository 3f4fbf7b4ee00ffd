"""Every Triton kernel compiles for sm_90 with the installed Triton, without a GPU (see compile_sm90.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_kernels_compile_for_hopper() -> None:
    pytest.importorskip("triton.backends.nvidia", reason="this Triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # whatever made gem_precision importable here
    script = Path(__file__).with_name("compile_sm90.py")
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert set(report) == {
        "mx_quantize", "mx_quantize_cols", "mx_dequantize", "fp8_stats", "fp8_cast", "fp8_rows", "fp8_blocks_t", "mx_gemm",
        "mx_gemm_bf16",
    }  # fmt: skip
    for name, facts in report.items():
        assert facts["spills"] in (0, None), f"{name} spills registers: {facts}"
    for name in ("mx_quantize", "mx_quantize_cols", "fp8_cast", "fp8_rows", "fp8_blocks_t"):
        assert report[name]["rne_cast"], f"{name}: the fp8 cast is not cvt.rn.satfinite"
    for name in ("mx_gemm", "mx_gemm_bf16"):
        assert report[name]["wgmma"], f"{name}: the MX GEMM does not use Hopper's wgmma"
