"""The producers' quantized rows (gem_kernels.quantized_rows_triton): the layer norm fork and the norm-gate
forward, asked for their output's e4m3 rows, write the same output and gradients as without, and rows
that stand for that output (the layer norm's backward likewise for the gradient it writes, offered to
the upstream linear's slot): column maxima equal to the output's, every byte within e4m3 rounding of
``y / scale_inv``. (Their bits against gem-precision's reference quantizer: the root
tests/test_producer_quantization.py, where both packages are installed.)

Runs in Triton's interpreter on fresh random data; fresh memory is NaN or all ones (``poison``), so a row
or byte no kernel wrote fails a test.
"""

from __future__ import annotations

import math

import pytest
import torch

from gem_kernels.hstu_gap_triton import hstu_gap_triton
from gem_kernels.layer_norm_triton import _launch_shape, norm_fork
from gem_kernels.norm_gate_triton import NormGateFunction
from gem_kernels.quantized_rows_triton import ROWS_PER_PROGRAM_WITH_COLUMNS, RowsOut
from gem_kernels.testing import assert_offer_stands_for, assert_rows_stand_for, offsets_from_lengths
from gem_model.api import GradRowsSlot, RowQuantization

pytestmark = pytest.mark.usefixtures("poison")

ROWS = 2 * ROWS_PER_PROGRAM_WITH_COLUMNS + 5  # three programs merge their column maxima, the last one short
WIDTH = 40  # not a power of two: the tile's last columns are masked


@pytest.mark.parametrize("column_amax", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norm_fork_writes_its_rows_and_the_same_output_and_gradient(gen, dtype, column_amax):
    x = (torch.randn(ROWS, WIDTH, generator=gen) * 3 + 1).to(dtype)
    d_ln, d_skip = torch.randn(ROWS, WIDTH, generator=gen).to(dtype), torch.randn(ROWS, WIDTH, generator=gen).to(dtype)
    results = []
    for quantize in (None, RowQuantization(column_amax=column_amax)):
        xi = x.clone().requires_grad_()
        ln, skip, rows = norm_fork(xi, quantize=quantize)
        results.append((ln, rows, *torch.autograd.grad([ln, skip], xi, [d_ln, d_skip])))
    (ln, none, dx), (ln_q, rows, dx_q) = results
    assert none is None
    assert torch.equal(ln_q, ln) and torch.equal(dx_q, dx)
    assert_rows_stand_for(rows, ln, column_amax=column_amax)


@pytest.mark.parametrize("silu_gate", [True, False])
def test_norm_gate_forward_writes_its_rows_and_the_same_output(gen, silu_gate):
    x = torch.randn(ROWS, WIDTH, generator=gen).bfloat16()
    u = (torch.randn(ROWS, WIDTH, generator=gen) * 2).bfloat16()
    weight, bias = 1 + 0.1 * torch.randn(WIDTH, generator=gen), 0.1 * torch.randn(WIDTH, generator=gen)
    y, mean, rstd = NormGateFunction.run_forward(x, u, weight, bias, 1e-6, silu_gate=silu_gate)
    out = RowsOut.allocate(ROWS, WIDTH, x.device, RowQuantization(column_amax=True))
    y_q, mean_q, rstd_q = NormGateFunction.run_forward(x, u, weight, bias, 1e-6, silu_gate=silu_gate, rows_out=out)
    assert torch.equal(y_q, y) and torch.equal(mean_q, mean) and torch.equal(rstd_q, rstd)
    assert_rows_stand_for(out.result(), y, column_amax=True)


def test_the_gap_returns_its_rows_and_the_same_output_and_gradients(gen):
    heads, dqk, dv = 2, 16, 16
    offsets = offsets_from_lengths([5, 0, 7])
    pre = (torch.randn(12, heads * (2 * dv + 2 * dqk), generator=gen) * 2).bfloat16()
    weight, bias = 1 + 0.1 * torch.randn(heads * dv, generator=gen), 0.1 * torch.randn(heads * dv, generator=gen)
    dy = torch.randn(12, heads * dv, generator=gen).bfloat16()
    results = []
    for quantize in (None, RowQuantization(column_amax=True)):
        leaves = [t.clone().requires_grad_() for t in (pre, weight, bias)]
        y, rows = hstu_gap_triton(*leaves, offsets, num_heads=heads, attention_dim=dqk, value_dim=dv, max_seq_len=8,
                                  alpha=1 / math.sqrt(dqk), eps=1e-6, dq_mode="separate", quantize=quantize)  # fmt: skip
        results.append((y, rows, torch.autograd.grad(y, leaves, dy)))
    (y, none, grads), (y_q, rows, grads_q) = results
    assert none is None and torch.equal(y_q, y)
    assert all(torch.equal(a, b) for a, b in zip(grads_q, grads))
    assert not rows.data.requires_grad and not rows.scale_inv.requires_grad
    assert_rows_stand_for(rows, y, column_amax=True)


@pytest.mark.parametrize("asked", ["rows", "rows_and_sums", "sums"])
@pytest.mark.parametrize("with_skip", [True, False])
@pytest.mark.parametrize("sum_tiles", [1, 3])
def test_norm_fork_backward_offers_what_the_slot_asks_and_writes_the_same_gradient(gen, monkeypatch, asked,
                                                                                   with_skip, sum_tiles):  # fmt: skip
    """Given the slot of the linear upstream, the layer norm's backward writes the same ``dx`` and offers
    what the slot asks for: e4m3 rows standing for it, and, to a slot that asks for the sums alone, its
    float32 column sums (the linear's bias gradient) within float32 rounding of float64's sums of ``dx`` as
    stored, over several programs, the last one short (with several tiles a program, the last program's
    tiles partly past the rows). Beside rows the sums are left to the linear (``COLUMN_SUMS``)."""
    monkeypatch.setattr("gem_kernels.layer_norm_triton.SUM_TILES", sum_tiles)
    monkeypatch.setattr("gem_kernels.layer_norm_triton.COLUMN_SUMS", True)
    rows = 2 * _launch_shape(WIDTH, backward=True)[1] * sum_tiles + 3
    x = (torch.randn(rows, WIDTH, generator=gen) * 3 + 1).bfloat16()
    d_ln, d_skip = torch.randn(rows, WIDTH, generator=gen).bfloat16(), torch.randn(rows, WIDTH, generator=gen).bfloat16()
    results = []
    for slot in (None, GradRowsSlot(column_sum=asked != "rows", rows=asked != "sums")):
        xi = x.clone().requires_grad_()
        ln, skip, _ = norm_fork(xi, grad_rows=slot)
        outputs, grads = ([ln, skip], [d_ln, d_skip]) if with_skip else ([ln], [d_ln])
        results.append((slot, torch.autograd.grad(outputs, xi, grads)[0]))
    (_, dx), (slot, dx_s) = results
    assert torch.equal(dx_s, dx)
    assert_offer_stands_for(slot.take(dx_s), dx, rows=asked != "sums", sums=asked == "sums")
    with pytest.raises(TypeError, match="GradRowsSlot"):
        norm_fork(x, grad_rows="slot")


def test_norm_fork_backward_leaves_the_sums_to_the_linear_when_switched_off(gen, monkeypatch):
    """Without ``COLUMN_SUMS``, a slot that asks for rows and sums is offered rows alone (as with it), and one
    that asks for sums alone is offered nothing (its linear sums the gradient it gets)."""
    monkeypatch.setattr("gem_kernels.layer_norm_triton.COLUMN_SUMS", False)
    x = torch.randn(9, WIDTH, generator=gen).bfloat16().requires_grad_()
    for rows in (True, False):
        slot = GradRowsSlot(column_sum=True, rows=rows)
        ln, _, _ = norm_fork(x, grad_rows=slot)
        (dx,) = torch.autograd.grad(ln, x, torch.randn(9, WIDTH, generator=gen).bfloat16())
        offered = slot.take(dx)
        assert (offered is not None and offered.column_sum is None) if rows else offered is None
