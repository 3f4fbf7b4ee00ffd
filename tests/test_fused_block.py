"""An HSTU block on gem-kernels' ``triton`` kernels: fused around its linears (layer norm with the
residual branch, then silu, split, attention and norm-gate as one function) against the same block with
``fuse_block: off`` (every op by itself), on the same weights and fresh random inputs, forward and every
gradient. Triton runs in its interpreter here.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gem_kernels.attention import TritonJaggedAttention
from gem_kernels.norm_gate import TorchNormGate, TritonNormGate
from gem_kernels.testing import block_output_and_grads, offsets_from_lengths, relative_error
from gem_model.model.hstu import HSTUBlock


def block(fuse_block: str, *, norm_gate=None, position_bias: bool = False) -> HSTUBlock:
    attention = TritonJaggedAttention(TritonJaggedAttention.Config(fuse_block=fuse_block))
    return HSTUBlock(dim=32, num_heads=2, attention_dim=16, value_dim=16, max_seq_len=16, max_attn_len=0, alpha=0.25,
                     dropout=0.0, attention=attention, norm_gate=norm_gate or TritonNormGate(),
                     position_bias=position_bias)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_block_matches_the_unfused_block(dtype):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ()).item()))
    fused = block("on", position_bias=True)
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5))
    plain = copy.deepcopy(fused)
    plain.fuse = False
    assert fused.fused is not None and plain.fused is None
    offsets = offsets_from_lengths([6, 0, 11, 3])
    targets = torch.tensor([1, 0, 2, 1])
    x = torch.randn(20, 32, generator=gen).to(dtype)
    dy = torch.randn(20, 32, generator=gen).to(dtype)
    results = []
    for b in (fused, plain):
        results.append(block_output_and_grads(b.to(dtype), x, dy, offsets, targets))
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    (y_f, g_f), (y_p, g_p) = results
    assert relative_error(y_f, y_p) < tolerance
    names = ["x", *(n for n, _ in fused.named_parameters())]
    for name, a, b in zip(names, g_f, g_p):
        assert relative_error(a, b) < tolerance, f"d {name}: {relative_error(a, b):.2e}"


def test_fuse_block_follows_the_norm_gate_kernel():
    assert block("auto").fused is not None
    assert block("auto", norm_gate=TorchNormGate()).fused is None  # the fused path is triton's norm-gate
    assert block("off").fused is None
    with pytest.raises(ValueError, match="fuse_block=on fuses the norm-gate of kernels.norm_gate 'triton'"):
        block("on", norm_gate=TorchNormGate())
