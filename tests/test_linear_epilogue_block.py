"""The fused HSTU block with its GEMMs supplied by gem-kernels (``hstu_block.LINEAR_SILU``,
``LINEAR_RESIDUAL``): the ``bf16`` scheme's ``uvqk`` linear runs ``linear_silu``, whose epilogue writes
``silu(v, q, k)``, and the gap skips its own silu pass; its ``out`` linear runs ``linear_residual``,
which adds the residual. Against the same block on the scheme's own GEMMs, on the same weights and fresh
random inputs, forward and every gradient; and the cases that must keep the scheme's GEMMs.

Triton runs in its interpreter (the root conftest.py sets it on a machine without a GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch

import gem_kernels.hstu_block as hstu_block
import gem_kernels.hstu_gap_triton as gap
from gem_kernels.attention import TritonJaggedAttention
from gem_kernels.hstu_gap_triton import hstu_gap_triton
from gem_kernels.norm_gate import TritonNormGate
from gem_kernels.testing import block_output_and_grads, offsets_from_lengths, relative_error
from gem_model.api import takes_gemm
from gem_model.model.hstu import HSTUBlock
from gem_precision.schemes import Bf16Scheme, Fp8RowwiseScheme


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def block(scheme, gen: torch.Generator, **attention) -> HSTUBlock:
    b = HSTUBlock(dim=32, num_heads=2, attention_dim=16, value_dim=16, max_seq_len=16, max_attn_len=0, alpha=0.25,
                  dropout=0.0, attention=TritonJaggedAttention(TritonJaggedAttention.Config(**attention)),
                  norm_gate=TritonNormGate(), position_bias=True)  # fmt: skip
    with torch.no_grad():
        for p in b.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5))
    b.uvqk = scheme.convert_linear(b.uvqk, "blocks.0.uvqk")
    b.out = scheme.convert_linear(b.out, "blocks.0.out")
    return b.to(torch.bfloat16)


def count_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the block ran ``linear_silu``, ``linear_residual`` and the gap's forward silu pass
    (``silu_columns`` without grad)."""
    calls = {"linear_silu": 0, "linear_residual": 0, "silu_pass": 0}
    real_silu, real_residual, real_pass = hstu_block.linear_silu, hstu_block.linear_residual, gap.silu_columns

    def silu(*args, **kwargs):
        calls["linear_silu"] += 1
        return real_silu(*args, **kwargs)

    def residual(*args, **kwargs):
        calls["linear_residual"] += 1
        return real_residual(*args, **kwargs)

    def silu_pass(pre, out, grad=None, scale_inv=None):
        calls["silu_pass"] += grad is None
        return real_pass(pre, out, grad, scale_inv)

    monkeypatch.setattr(hstu_block, "linear_silu", silu)
    monkeypatch.setattr(hstu_block, "linear_residual", residual)
    monkeypatch.setattr(gap, "silu_columns", silu_pass)
    return calls


@pytest.mark.parametrize(("switches", "bias_grad_in_gap"), [
    (("LINEAR_SILU",), False), (("LINEAR_SILU",), True), (("LINEAR_RESIDUAL",), False),
    (("LINEAR_SILU", "LINEAR_RESIDUAL"), True),
])  # fmt: skip
def test_the_block_on_supplied_gemms_matches_the_block_on_the_schemes_gemms(gen, monkeypatch, switches,
                                                                          bias_grad_in_gap):  # fmt: skip
    fused = block(Bf16Scheme(), gen, fuse_block="on", bias_grad_in_gap=bias_grad_in_gap)
    plain = copy.deepcopy(fused)
    offsets, targets = offsets_from_lengths([6, 0, 11, 3]), torch.tensor([1, 0, 2, 1])
    x = torch.randn(20, 32, generator=gen).bfloat16()
    dy = torch.randn(20, 32, generator=gen).bfloat16()
    assert takes_gemm(fused.uvqk, x) and takes_gemm(fused.out, x)
    calls = count_calls(monkeypatch)
    for flag in ("LINEAR_SILU", "LINEAR_RESIDUAL"):  # each epilogue on exactly where the case names it
        monkeypatch.setattr(hstu_block, flag, flag in switches)
    y_f, g_f = block_output_and_grads(fused, x, dy, offsets, targets)
    silu = "LINEAR_SILU" in switches
    want = {"linear_silu": int(silu), "linear_residual": int("LINEAR_RESIDUAL" in switches), "silu_pass": int(not silu)}
    assert calls == want
    for switch in switches:
        monkeypatch.setattr(hstu_block, switch, False)
    y_p, g_p = block_output_and_grads(plain, x, dy, offsets, targets)
    assert calls == {**want, "silu_pass": want["silu_pass"] + 1}
    # bf16 activations: pre rounded from another accumulation order, then through silu, attention and
    # norm-gate; the output rounded once instead of twice
    assert relative_error(y_f, y_p) < 3e-2
    names = ["x", *(n for n, _ in fused.named_parameters())]
    for name, a, b in zip(names, g_f, g_p, strict=True):
        assert relative_error(a, b) < 3e-2, f"d {name}: {relative_error(a, b):.2e}"
    if "LINEAR_SILU" not in switches:  # the same forward up to out, and the same gradient reaches out's input
        assert torch.equal(g_f[names.index("out.weight")], g_p[names.index("out.weight")])


def test_the_schemes_gemm_stays_where_the_epilogue_cannot_serve(gen, monkeypatch):
    """fp8_rowwise's linears take no supplied GEMM; the gap refuses a post beside fp8_forward, or of the
    wrong shape."""
    monkeypatch.setattr(hstu_block, "LINEAR_SILU", True)
    monkeypatch.setattr(hstu_block, "LINEAR_RESIDUAL", True)
    calls = count_calls(monkeypatch)
    offsets, targets = offsets_from_lengths([6, 0, 11, 3]), torch.tensor([1, 0, 2, 1])
    x = torch.randn(20, 32, generator=gen).bfloat16()
    fp8 = block(Fp8RowwiseScheme(Fp8RowwiseScheme.Config(backend="emulated")), gen, fuse_block="on")
    assert not takes_gemm(fp8.uvqk, x)
    fp8(x, offsets, targets)
    assert calls == {"linear_silu": 0, "linear_residual": 0, "silu_pass": 1}
    pre = torch.randn(20, 128, generator=gen).bfloat16()
    with pytest.raises(ValueError, match="cannot be given with saved_format or fp8_forward"):
        hstu_gap_triton(pre, torch.ones(32), torch.zeros(32), offsets, num_heads=2, attention_dim=16, value_dim=16,
                        max_seq_len=16, alpha=0.25, eps=1e-6, fp8_forward=True, post=torch.empty(20, 96).bfloat16())  # fmt: skip
    with pytest.raises(ValueError, match=r"post must be a contiguous torch.bfloat16 \[20, 96\]"):
        hstu_gap_triton(pre, torch.ones(32), torch.zeros(32), offsets, num_heads=2, attention_dim=16, value_dim=16,
                        max_seq_len=16, alpha=0.25, eps=1e-6, post=torch.empty(20, 128).bfloat16())  # fmt: skip
