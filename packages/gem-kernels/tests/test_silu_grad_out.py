"""Attention gradient passes that store their output times ``silu'(pre)`` and sum its columns
(gem_kernels.silu_grad_out): the Triton ``dq`` pass's epilogue against the plain pass and a float64
reference; the pass after a kernel without it (Triton ``key_major``) against the gap's own ``silu'`` pass;
the norm-gate backward's ``u`` column sums; the fused block with ``SILU_GRAD_IN_ATTENTION`` against the
block without it (forward, every gradient, the bias sums); the Gluon dk/dv pass with the epilogue
compiled for sm_90; and the arguments refused. Triton runs in its interpreter; fresh memory is NaN."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from gem_kernels.attention_triton import query_major
from gem_kernels.attention_triton_bwd import key_major
from gem_kernels.hstu_gap_bias import silu_grad_columns
from gem_kernels.norm_gate_triton import norm_gate_backward
from gem_kernels.silu_grad_out import SiluGradOut
from gem_kernels.testing import block_output_and_grads, offsets_from_lengths, relative_error

pytestmark = pytest.mark.usefixtures("poison")

HEADS, DIM = 2, 16
OPTIONS = dict(max_seq_len=12, alpha=0.3, max_attn_len=0)


def _silu_grad(z: torch.Tensor) -> torch.Tensor:
    sig = torch.sigmoid(z.double())
    return sig * (1 + z.double() * (1 - sig))


def _inputs(gen: torch.Generator, dtype: torch.dtype, rows: int) -> tuple[torch.Tensor, ...]:
    """q, k, v, the output gradient, and the gap's two wide tensors: ``pre`` and its gradient ``d_pre``,
    ``[rows, 3 H D]`` (three column blocks, as the gap's v, q, k), ``d_pre`` poisoned."""
    q, k, v, g = (torch.randn(rows, HEADS, DIM, generator=gen).to(dtype) for _ in range(4))
    pre = (2 * torch.randn(rows, 3 * HEADS * DIM, generator=gen)).to(dtype)
    return q, k, v, g, pre, torch.full_like(pre, float("nan"))


def _block(t: torch.Tensor, i: int) -> torch.Tensor:
    """Column block ``i`` of a ``[rows, 3 H D]`` tensor as ``[rows, H, D]`` (a strided view)."""
    return t[:, i * HEADS * DIM:(i + 1) * HEADS * DIM].view(t.shape[0], HEADS, DIM)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_sums", [True, False])
def test_the_dq_pass_stores_dq_times_silu_prime_and_sums_its_columns(gen, dtype, with_sums):
    offsets = offsets_from_lengths([5, 0, 12, 3])
    targets = torch.tensor([1, 0, 2, 0])
    q, k, v, g, pre, d_pre = _inputs(gen, dtype, 20)
    plain = query_major(q, k, v, g, offsets, targets, **OPTIONS)  # dq, float32 result in the fp32 case
    sums = torch.zeros(HEADS * DIM) if with_sums else None
    out = _block(d_pre, 1)
    query_major(q, k, v, g, offsets, targets, out=out, silu_pre=SiluGradOut(_block(pre, 1), sums), **OPTIONS)
    assert not torch.isnan(d_pre[:, HEADS * DIM:2 * HEADS * DIM]).any()  # every row and column written
    assert torch.isnan(d_pre[:, :HEADS * DIM]).all() and torch.isnan(d_pre[:, 2 * HEADS * DIM:]).all()  # no other
    reference = plain.double() * _silu_grad(_block(pre, 1))
    # fp32: the same accumulator times silu'; bf16: one rounding of that product, against the plain pass's
    # rounding of dq, then of the product
    assert relative_error(out, reference) < (1e-5 if dtype == torch.float32 else 1e-2)
    if with_sums:
        torch.testing.assert_close(sums, out.double().sum(0).flatten().float(), rtol=1e-5, atol=1e-5)


def test_key_major_without_the_epilogue_applies_it_after_its_kernel(gen):
    """The Triton key-major kernel (the CPU's route) stores dk and dv, then the pass after it: the same
    bits as the gap's own silu' pass over those columns, and its sums."""
    offsets = offsets_from_lengths([7, 9, 4])
    q, k, v, g, pre, d_pre = _inputs(gen, torch.bfloat16, 20)
    dk, dv = key_major(q, k, v, g, offsets, None, None, **OPTIONS)
    sums = torch.zeros(2, HEADS * DIM)
    key_major(q, k, v, g, offsets, None, None, out=(_block(d_pre, 2), _block(d_pre, 0)),
              silu_pre=(SiluGradOut(_block(pre, 2), sums[0]), SiluGradOut(_block(pre, 0), sums[1])), **OPTIONS)
    for i, (grad, block_sums) in enumerate(((dk, sums[0]), (dv, sums[1]))):
        cols = slice((2 - 2 * i) * HEADS * DIM, (3 - 2 * i) * HEADS * DIM)
        expected = torch.empty(20, HEADS * DIM, dtype=torch.bfloat16)
        expected_sums = silu_grad_columns(pre[:, cols], expected, grad.reshape(20, -1))
        assert torch.equal(d_pre[:, cols], expected)
        torch.testing.assert_close(block_sums, expected_sums, rtol=1e-6, atol=1e-6)
    assert torch.isnan(d_pre[:, HEADS * DIM:2 * HEADS * DIM]).all()  # the q block untouched


def test_the_norm_gate_backward_sums_the_gate_gradient_it_stores(gen):
    rows, dim = 37, 48
    x, u, dy = (torch.randn(rows, dim, generator=gen).to(torch.bfloat16) for _ in range(3))
    weight, bias = torch.randn(dim, generator=gen), torch.randn(dim, generator=gen)
    mean = x.float().mean(1)
    rstd = torch.rsqrt(x.float().var(1, unbiased=False) + 1e-5)
    plain = norm_gate_backward(dy, x, u, weight, bias, mean, rstd, silu_gate=True)
    sums = torch.full((dim,), float("nan"))
    summed = norm_gate_backward(dy, x, u, weight, bias, mean, rstd, silu_gate=True, du_sums=sums)
    for a, b in zip(plain, summed):
        assert torch.equal(a, b)  # the sums change nothing else
    torch.testing.assert_close(sums, plain[1].double().sum(0).float(), rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match=r"du_sums must be float32 \[48\], got torch.bfloat16 \(48,\)"):
        norm_gate_backward(dy, x, u, weight, bias, mean, rstd, silu_gate=True, du_sums=sums.to(torch.bfloat16))


def block(**options):
    from gem_kernels.attention import TritonJaggedAttention
    from gem_kernels.norm_gate import TritonNormGate
    from gem_model.model.hstu import HSTUBlock

    attention = TritonJaggedAttention(TritonJaggedAttention.Config(fuse_block="on", **options))
    return HSTUBlock(dim=32, num_heads=2, attention_dim=16, value_dim=16, max_seq_len=16, max_attn_len=0, alpha=0.25,
                     dropout=0.0, attention=attention, norm_gate=TritonNormGate())  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias_in_gap", [True, False])
def test_the_block_with_silu_prime_in_the_attention_passes_matches_the_block_with_the_last_pass(
        gen, dtype, bias_in_gap, monkeypatch):  # fmt: skip
    import gem_kernels.hstu_gap_triton as gap

    calls = {"last_pass": 0, "epilogue": 0}
    real_rows, real_query = gap.silu_grad_rows, gap.query_major
    monkeypatch.setattr(gap, "silu_grad_rows", lambda *a, **k: calls.__setitem__("last_pass", calls["last_pass"] + 1)
                        or real_rows(*a, **k))
    monkeypatch.setattr(gap, "query_major", lambda *a, **k: calls.__setitem__(
        "epilogue", calls["epilogue"] + (k.get("silu_pre") is not None)) or real_query(*a, **k))
    fused = block(dq="separate", bias_grad_in_gap=bias_in_gap)
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5))
    offsets = offsets_from_lengths([6, 0, 11, 3])
    targets = torch.tensor([1, 0, 2, 1])
    x = torch.randn(20, 32, generator=gen).to(dtype)
    dy = torch.randn(20, 32, generator=gen).to(dtype)
    results = {}
    for on in (True, False):
        monkeypatch.setattr(gap, "SILU_GRAD_IN_ATTENTION", on)
        results[on] = block_output_and_grads(copy.deepcopy(fused).to(dtype), x, dy, offsets, targets)
    assert calls["epilogue"] == 1 and calls["last_pass"] == (1 if bias_in_gap else 0)
    (y_on, g_on), (y_off, g_off) = results[True], results[False]
    assert torch.equal(y_on, y_off)
    names = ["x", *(n for n, _ in fused.named_parameters())]
    for name, a, b in zip(names, g_on, g_off):
        # bf16: dq is rounded once (times silu') where the last pass rounded it twice; the bias sums differ
        # in the order of their additions
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert relative_error(a, b) <= tolerance, f"d {name}: {relative_error(a, b):.2e}"


def test_the_epilogue_is_refused_where_it_cannot_stand(gen):
    offsets = offsets_from_lengths([5, 3])
    q, k, v, g, pre, d_pre = _inputs(gen, torch.float32, 8)
    with pytest.raises(ValueError, match="query_major: silu_pre is for the dq pass"):
        query_major(q, k, v, None, offsets, None, silu_pre=SiluGradOut(_block(pre, 0)), **OPTIONS)
    with pytest.raises(ValueError, match=r"query_major: silu_pre.pre must have the output's shape, strides"):
        query_major(q, k, v, g, offsets, None, out=_block(d_pre, 0), silu_pre=SiluGradOut(q.clone()), **OPTIONS)
    with pytest.raises(ValueError, match=r"key_major \(dv\): silu_pre.sums must be a contiguous float32 \[32\]"):
        key_major(q, k, v, g, offsets, None, None, out=(_block(d_pre, 2), _block(d_pre, 0)),
                  silu_pre=(SiluGradOut(_block(pre, 2)), SiluGradOut(_block(pre, 0), torch.zeros(16))), **OPTIONS)


GLUON_SCRIPT = """
import json
from gem_kernels.compile_report import compile_gluon_forward
for silu_out in (False, True):
    print(json.dumps({"silu_out": silu_out, **compile_gluon_forward("n64m32", dkdv=True, silu_out=silu_out)}))
"""


def test_the_gluon_dkdv_pass_with_the_epilogue_compiles_for_hopper_at_two_programs_an_sm():
    """Gluon has no interpreter: its numbers are ``benchmarks/attention_gluon.py --silu-out``'s, on the GPU."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", GLUON_SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    plain, epilogue = (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{"))
    assert epilogue["fit_per_sm"] >= 2 and epilogue["programs_per_sm"] == 2, epilogue
    # the epilogue's loads of pre beside dk and dv: at most 32 bytes of spill (Triton 3.7.1: 32, against 8)
    assert epilogue["stack_bytes"] <= 32, epilogue
    # the column sums cross warps through shared memory: a few barriers more, the same MMA schedule
    assert epilogue["barriers"] > plain["barriers"] and epilogue["mma_order"] == plain["mma_order"], (plain, epilogue)
