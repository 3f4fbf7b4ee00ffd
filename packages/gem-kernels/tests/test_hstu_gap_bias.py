"""The uvqk bias gradient summed by the fused gap's own backward passes (gem_kernels.hstu_gap_bias):
the ``silu'`` pass with column sums against the plain pass and torch, and the whole fused block with
``bias_grad_in_gap`` against the block without it (forward and every gradient), by both of its paths:
one pass over whole rows, and per column block for rows too wide to hold. Triton runs in its interpreter; fresh memory is NaN (``poison``)."""

from __future__ import annotations

import copy

import pytest
import torch

from gem_kernels.attention import TritonJaggedAttention
from gem_kernels.hstu_gap_bias import silu_grad_columns
from gem_kernels.hstu_gap_grad_rows import silu_grad_rows
from gem_kernels.hstu_gap_saved import silu_quantize_rows
from gem_kernels.hstu_gap_triton import silu_columns
from gem_kernels.norm_gate import TritonNormGate
from gem_kernels.testing import block_output_and_grads, offsets_from_lengths, relative_error
from gem_model.model.hstu import HSTUBlock

pytestmark = pytest.mark.usefixtures("poison")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 37])  # one program with one tile; three programs, tiles to spare
def test_silu_gradient_with_column_sums_writes_what_the_plain_pass_writes_and_sums_it(gen, dtype, rows):
    pre = torch.randn(rows, 150, generator=gen).to(dtype)  # 150: a partial column block
    grad = torch.randn(rows, 150, generator=gen).to(dtype)
    plain = silu_columns(pre, torch.full_like(pre, float("nan")), grad=grad)
    out = torch.full_like(pre, float("nan"))
    sums = silu_grad_columns(pre, out, grad)
    assert torch.equal(out, plain)
    torch.testing.assert_close(sums, plain.double().sum(0).float(), rtol=1e-6, atol=1e-5)
    reference = (grad.double() * torch.sigmoid(pre.double()) * (1 + pre.double() * (1 - torch.sigmoid(pre.double()))))
    assert relative_error(out, reference) < (1e-6 if dtype == torch.float32 else 1e-2)


def test_silu_gradient_with_column_sums_in_place_and_from_e4m3_rows_with_an_fp32_gradient(gen):
    pre = torch.randn(29, 96, generator=gen).to(torch.bfloat16)
    data, scale_inv = silu_quantize_rows(pre, torch.empty(29, 64, dtype=torch.bfloat16), 32)
    grad = torch.randn(29, 96, generator=gen)  # float32, as the atomic dq accumulator is
    plain = silu_columns(data, torch.empty(29, 96, dtype=torch.bfloat16), grad=grad, scale_inv=scale_inv)
    out = torch.empty(29, 96, dtype=torch.bfloat16)
    sums = silu_grad_columns(data, out, grad, scale_inv=scale_inv)
    assert torch.equal(out, plain)
    torch.testing.assert_close(sums, plain.double().sum(0).float(), rtol=1e-6, atol=1e-5)
    in_place = grad.to(torch.bfloat16)
    expected = silu_columns(data, torch.empty_like(in_place), grad=in_place.clone(), scale_inv=scale_inv)
    sums = silu_grad_columns(data, in_place, in_place, scale_inv=scale_inv)
    assert torch.equal(in_place, expected)
    torch.testing.assert_close(sums, expected.double().sum(0).float(), rtol=1e-6, atol=1e-5)


def block(**options) -> HSTUBlock:
    attention = TritonJaggedAttention(TritonJaggedAttention.Config(fuse_block="on", **options))
    return HSTUBlock(dim=32, num_heads=2, attention_dim=16, value_dim=16, max_seq_len=16, max_attn_len=0, alpha=0.25,
                     dropout=0.0, attention=attention, norm_gate=TritonNormGate())  # fmt: skip


@pytest.mark.parametrize(("dtype", "dq", "path"), [
    (torch.float32, "atomic", "whole_rows"), (torch.float32, "separate", "whole_rows"),
    (torch.bfloat16, "atomic", "whole_rows"), (torch.bfloat16, "separate", "whole_rows"),
    (torch.bfloat16, "separate", "whole_rows_u_sums_in_pass"),  # the u columns summed by the last pass too
    (torch.bfloat16, "atomic", "column_blocks"),  # three passes: q from the accumulator, v and k in place
])  # fmt: skip
def test_the_block_with_the_bias_gradient_in_the_gap_matches_the_block_without(gen, dq, dtype, path, monkeypatch):
    import gem_kernels.hstu_gap_triton as gap

    calls = []
    u_in_norm_gate = path == "whole_rows"  # gap.U_SUMS_IN_NORM_GATE: the norm-gate backward sums the u columns
    monkeypatch.setattr(gap, "U_SUMS_IN_NORM_GATE", u_in_norm_gate)
    if path.startswith("whole_rows"):  # rows that fit: one pass over whole rows, no e4m3 rows written (hstu_gap_grad_rows)
        def rows_pass(pre, d_pre, hv, out, **kw):
            assert out is None and kw["col_sum"] and (kw["dq"] is not None) == (dq == "atomic")
            assert kw["u_summed"] == u_in_norm_gate
            calls.append(1)
            return silu_grad_rows(pre, d_pre, hv, out, **kw)

        monkeypatch.setattr(gap, "silu_grad_rows", rows_pass)
    else:  # rows too wide for registers: the silu' pass per column block, the u columns by a torch sum
        monkeypatch.setattr(gap, "fits", lambda width: False)
        monkeypatch.setattr(gap, "silu_grad_columns", lambda *a, **k: calls.append(1) or silu_grad_columns(*a, **k))
    summing = block(dq=dq, bias_grad_in_gap=True)
    with torch.no_grad():
        for p in summing.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5))
    plain = copy.deepcopy(summing)
    plain.attention = TritonJaggedAttention(TritonJaggedAttention.Config(fuse_block="on", dq=dq, bias_grad_in_gap=False))
    offsets = offsets_from_lengths([6, 0, 11, 3])
    targets = torch.tensor([1, 0, 2, 1])
    x = torch.randn(20, 32, generator=gen).to(dtype)
    dy = torch.randn(20, 32, generator=gen).to(dtype)
    results = []
    for b in (summing, plain):
        results.append(block_output_and_grads(b.to(dtype), x, dy, offsets, targets))
        assert type(b.uvqk.bias) is torch.nn.Parameter and b.uvqk.bias.requires_grad  # given back after the call
    (y_s, g_s), (y_p, g_p) = results
    # the summing passes ran for the first block only
    assert len(calls) == (3 if dq == "atomic" and path == "column_blocks" else 1)
    assert torch.equal(y_s, y_p)  # the forward is the same computation
    names = ["x", *(n for n, _ in summing.named_parameters())]
    for name, a, c in zip(names, g_s, g_p):
        tolerance = 1e-5 if dtype == torch.float32 else (1e-2 if name == "uvqk.bias" else 0)
        # only the order of the bias sums' additions differs
        assert relative_error(a, c) <= tolerance, f"d {name}: {relative_error(a, c):.2e}"
