"""The HSTU block's GEMMs with pointwise epilogues (gem_kernels.linear_epilogue_triton) against float64
references: the uvqk projection's ``pre``, and its ``post`` against the block's silu pass
(``silu_columns``) bit for bit; the output projection with the residual added before its one rounding.

Runs in Triton's interpreter on fresh random data, 16-wide tiles; fresh memory is NaN (``poison``), so a
tile the kernel did not store fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from gem_kernels.hstu_gap_triton import silu_columns
from gem_kernels.linear_epilogue_triton import CONFIGS, DEFAULT_CONFIG, linear_residual, linear_silu

pytestmark = pytest.mark.usefixtures("poison")


def _inputs(gen: torch.Generator, m: int, k: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(m, k, generator=gen).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    return x, w, b


@pytest.mark.parametrize(("m", "k", "n", "silu_from", "with_bias"), [
    (37, 48, 64, 16, True),   # a partial row tile; K three tiles; silu over three of four column tiles
    (16, 16, 32, 0, False),   # silu over every column, no bias
    (9, 32, 48, 48, True),    # no silu columns at all
])  # fmt: skip
def test_matches_matmul_and_silu_pass(gen: torch.Generator, m: int, k: int, n: int, silu_from: int,
                                      with_bias: bool) -> None:  # fmt: skip
    x, w, b = _inputs(gen, m, k, n)
    bias = b if with_bias else None
    pre, post = linear_silu(x, w, bias, silu_from)
    ref = x.double() @ w.double().T + (b.double() if with_bias else 0.0)
    # bf16 output: half an ulp of rounding (2^-9 relative) over fp32 accumulation of bf16 products
    torch.testing.assert_close(pre.double(), ref, rtol=2**-8, atol=1e-5)
    assert post.shape == (m, n - silu_from)
    assert torch.equal(post, silu_columns(pre[:, silu_from:], torch.empty_like(post)))
    torch.testing.assert_close(post.double(), F.silu(ref[:, silu_from:]), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("config", ["m128n256k64s4", "m128n256k64s3"])
def test_the_epilogue_in_two_halves_writes_what_the_whole_tile_writes(gen: torch.Generator, config: str) -> None:
    """``subtile``: each tile's epilogue in two halves (32-wide tiles under the interpreter, 16 a half)."""
    x, w, b = _inputs(gen, 37, 48, 96)
    pre, post = linear_silu(x, w, b, 32, config=config)
    whole_pre, whole_post = linear_silu(x, w, b, 32)
    assert torch.equal(pre, whole_pre) and torch.equal(post, whole_post)
    residual = torch.randn(37, 96, generator=gen).bfloat16()
    assert torch.equal(linear_residual(x, w, b, residual, config=config), linear_residual(x, w, b, residual))


def test_pre_only_leaves_post_unwritten(gen: torch.Generator) -> None:
    x, w, b = _inputs(gen, 20, 16, 32)
    pre, post = linear_silu(x, w, b, 16, write_post=False)
    torch.testing.assert_close(pre.double(), x.double() @ w.double().T + b.double(), rtol=2**-8, atol=1e-5)
    assert post.isnan().all()  # poisoned memory, untouched


def test_no_rows(gen: torch.Generator) -> None:
    x, w, b = _inputs(gen, 0, 16, 32)
    pre, post = linear_silu(x, w, b, 16)
    assert pre.shape == (0, 32) and post.shape == (0, 16)
    assert linear_residual(x, w, b, torch.empty(0, 32).bfloat16()).shape == (0, 32)


@pytest.mark.parametrize(("m", "k", "n", "with_bias"), [(37, 48, 32, True), (16, 32, 48, False)])
def test_residual_is_added_before_the_one_rounding(gen: torch.Generator, m: int, k: int, n: int,
                                                  with_bias: bool) -> None:  # fmt: skip
    x, w, b = _inputs(gen, m, k, n)
    residual = (4 * torch.randn(m, n, generator=gen)).bfloat16()
    out = linear_residual(x, w, b if with_bias else None, residual)
    exact = residual.double() + x.double() @ w.double().T + (b.double() if with_bias else 0.0)
    # one rounding of an fp32 sum: within half a bf16 ulp, plus fp32 accumulation
    torch.testing.assert_close(out.double(), exact, rtol=2**-8, atol=1e-5)
    unfused = residual + F.linear(x, w, b if with_bias else None)  # two roundings
    assert (out.double() - exact).abs().sum() <= (unfused.double() - exact).abs().sum()


def test_residual_must_match_the_output(gen: torch.Generator) -> None:
    x, w, b = _inputs(gen, 8, 16, 32)
    with pytest.raises(ValueError, match=r"residual must be a contiguous torch.bfloat16 \[8, 32\]"):
        linear_residual(x, w, b, torch.zeros(8, 32))
    with pytest.raises(ValueError, match=r"residual must be a contiguous"):
        linear_residual(x, w, b, torch.zeros(32, 8).bfloat16().T)


@pytest.mark.parametrize(("change", "message"), [
    ({"silu_from": 8}, "silu_from=8 must be a multiple"),
    ({"silu_from": 48}, "silu_from=48 must be a multiple"),
    ({"weight": torch.zeros(32, 24, dtype=torch.bfloat16)}, r"x \(4, 16\) and weight \(32, 24\)"),
    ({"x": torch.zeros(4, 16)}, "must share a 16-bit dtype"),
    ({"bias": torch.zeros(16)}, r"bias \(16,\) is not \[N\] = \[32\]"),
    ({"x": torch.zeros(4, 4, dtype=torch.bfloat16), "weight": torch.zeros(32, 4, dtype=torch.bfloat16)},
     "multiple of 16 bytes"),
])  # fmt: skip
def test_bad_inputs_name_what_is_wrong(change: dict, message: str) -> None:
    args = {"x": torch.zeros(4, 16, dtype=torch.bfloat16), "weight": torch.zeros(32, 16, dtype=torch.bfloat16),
            "bias": torch.zeros(32), "silu_from": 16} | change  # fmt: skip
    with pytest.raises(ValueError, match=message):
        linear_silu(args["x"], args["weight"], args["bias"], args["silu_from"])


def test_configs_fit_the_hopper_tiles() -> None:
    """Every config the benchmark times divides the big config's silu boundary (1,024) and N (4,096)."""
    assert DEFAULT_CONFIG in CONFIGS
    for name, c in CONFIGS.items():
        assert 1024 % c.block_n == 0 and 4096 % c.block_n == 0, name


COMPILE_SCRIPT = """
import json
from gem_kernels.compile_report import compile_kernel
from gem_kernels.linear_epilogue_triton import CONFIGS, DEFAULT_CONFIG, RESIDUAL, SILU, _linear_epilogue
c = CONFIGS[DEFAULT_CONFIG]
pointers = dict.fromkeys(("X", "W", "BIAS", "OUT", "EXTRA"), "*bf16")
for epilogue in (SILU, RESIDUAL):
    constants = dict(HAS_BIAS=True, EPILOGUE=epilogue, BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
                     GROUP_M=c.group_m, SUBTILE=c.subtile, INTERP=False)
    signature = {n: pointers.get(n, "i32") for n in _linear_epilogue.arg_names if n not in constants}
    report = compile_kernel(_linear_epilogue, signature, constants, c.warps, c.stages, divisible=("N", "K", "SILU_FROM"))
    print(json.dumps({"epilogue": epilogue, **report}))
"""


def test_default_config_compiles_for_hopper() -> None:
    """The compiled path the interpreter never runs, both epilogues: sm_90, bulk tensor copies (TMA), one
    program's shared memory within the SM's 227 KiB, no spills."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [r["epilogue"] for r in reports] == [1, 2]
    for report in reports:
        assert report["tma_loads"], report
        assert report["shared_bytes"] <= 227 * 1024, report
        assert report["registers"] is not None and report["stack_bytes"] == 0, report
