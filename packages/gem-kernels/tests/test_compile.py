"""The compiled (GPU) path, which the interpreter never runs: compile every attention kernel for sm_90 on
CPU, without and with the relative biases, and the fused block's producers writing e4m3 rows."""

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
}
SCRIPT = """
import json
from gem_kernels.compile_report import Variant, compile_producer, compile_variant, configs
for v in ({variants}):
    r = compile_variant(v, configs(v.kernel, wide=False)[0])
    print(json.dumps({{"kernel": v.kernel, "dtype": v.dtype, "shared": r["shared_bytes"], "registers": r["registers"]}}))
for kernel, quantize, columns in ({producers}):  # the fused block's layer norm and norm-gate, writing e4m3 rows
    r = compile_producer(kernel, quantize=quantize, column_amax=columns)
    print(json.dumps({{"kernel": kernel, "shared": r["shared_bytes"], "registers": r["registers"]}}))
"""
PRODUCERS = {"plain": '[("norm", True, False), ("norm", True, True), ("norm_gate", True, True)]', "biases": "[]"}
HOPPER_SHARED_LIMIT = 227 * 1024
COUNTS = {"plain": 9, "biases": 4}


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
