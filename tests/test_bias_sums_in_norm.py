"""The ``bf16`` scheme's ``out`` linear takes its bias gradient from the next block's layer norm backward
(``bf16_linear.BIAS_SUMS_FROM_PRODUCER``, ``layer_norm_triton.COLUMN_SUMS``): that pass writes the
gradient of the linear's output, through the residual add, and sums its columns as it stores them, so
the linear does not read the gradient again for its bias.

Two fused blocks in a row, with the residual added in ``out``'s GEMM epilogue (the default) and without:
with the hand-over, every output and gradient is the same bits as without it, except the first block's
``out`` bias gradient, the same float32 sums in another order; that linear summed nothing itself, and the
last block's ``out`` (whose gradient comes from outside the blocks) summed its own.

On the CPU the ``bf16`` linear runs autograd's own GEMMs unless it is handed a GEMM (the residual epilogue
here), and it asks for no slot there: the test puts the slot it makes on a GPU in its place. Triton runs in
its interpreter (the root conftest.py sets it on a machine without a GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch

import gem_kernels.hstu_block as hstu_block
import gem_kernels.layer_norm_triton as layer_norm_triton
from gem_kernels.attention import TritonJaggedAttention
from gem_kernels.norm_gate import TritonNormGate
from gem_kernels.testing import offsets_from_lengths
from gem_model.api import GradRowsSlot
from gem_model.model.hstu import HSTUBlock
from gem_precision import bf16_linear
from gem_precision.schemes import Bf16Scheme


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def blocks(gen: torch.Generator) -> list[HSTUBlock]:
    scheme = Bf16Scheme()
    made = []
    for i in range(2):
        b = HSTUBlock(dim=32, num_heads=2, attention_dim=16, value_dim=16, max_seq_len=16, max_attn_len=0,
                      alpha=0.25, dropout=0.0, attention=TritonJaggedAttention(TritonJaggedAttention.Config(fuse_block="on")),
                      norm_gate=TritonNormGate(), position_bias=True)  # fmt: skip
        with torch.no_grad():
            for p in b.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5))
        b.uvqk = scheme.convert_linear(b.uvqk, f"blocks.{i}.uvqk")
        b.out = scheme.convert_linear(b.out, f"blocks.{i}.out")
        made.append(b.to(torch.bfloat16))
    return made


def output_and_grads(model: list[HSTUBlock], x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    offsets, targets = offsets_from_lengths([6, 0, 11, 3]), torch.tensor([1, 0, 2, 1])
    xi = x.clone().requires_grad_()
    y = xi
    for b in model:
        y = b(y, offsets, targets)
    params = [p for b in model for p in b.parameters()]
    return [y, *torch.autograd.grad(y, [xi, *params], dy)]


@pytest.mark.parametrize("residual_epilogue", [True, False])
def test_out_takes_its_bias_gradient_from_the_next_layer_norm(gen, monkeypatch, residual_epilogue: bool) -> None:
    handed = blocks(gen)
    plain = copy.deepcopy(handed)
    x, dy = torch.randn(20, 32, generator=gen).bfloat16(), torch.randn(20, 32, generator=gen).bfloat16()
    monkeypatch.setattr(hstu_block, "LINEAR_RESIDUAL", residual_epilogue)
    if not residual_epilogue:  # the scheme's own linear, through its function rather than autograd's GEMMs
        monkeypatch.setattr(bf16_linear, "_direct", lambda x, weight: True)
    summed: list[tuple[int, ...]] = []
    real_bias_grad = bf16_linear.bias_grad
    monkeypatch.setattr(bf16_linear, "bias_grad", lambda g: summed.append(tuple(g.shape)) or real_bias_grad(g))

    def on_gpu_slot(self: bf16_linear.Bf16Linear, device: torch.device) -> GradRowsSlot | None:
        return GradRowsSlot(column_sum=True, rows=False) if self.bias is not None and self.bias.requires_grad else None

    monkeypatch.setattr(bf16_linear.Bf16Linear, "grad_rows_slot", on_gpu_slot)
    assert layer_norm_triton.COLUMN_SUMS and bf16_linear.BIAS_SUMS_FROM_PRODUCER  # as shipped
    got = output_and_grads(handed, x, dy)
    assert summed == [(20, 32)]  # the last block's out alone (uvqk's bias gradients are the gaps')
    summed.clear()
    monkeypatch.setattr(layer_norm_triton, "COLUMN_SUMS", False)
    want = output_and_grads(plain, x, dy)
    assert summed == [(20, 32), (20, 32)]  # both outs sum their own
    names = ["y", "x", *(f"{i}.{n}" for i, b in enumerate(handed) for n, _ in b.named_parameters())]
    for name, a, b in zip(names, got, want, strict=True):
        if name == "0.out.bias":  # the layer norm's float32 sums of the same gradient, in another order
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b), f"{name} differs"

