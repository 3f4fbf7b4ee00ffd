"""The fused gap's last backward pass over whole rows (gem_kernels.hstu_gap_grad_rows): it completes the
gradient as the plain ``silu'`` passes do, writes e4m3 rows that stand for it, sums its columns, and
offers them through the uvqk linear's slot; the gap's gradients are unchanged by it. (The rows' bits
against gem-precision's reference quantizer, and the linear taking them: the root
tests/test_producer_quantization.py.) Triton runs in its interpreter on fresh random data; fresh
memory is NaN (``poison``), so an element no kernel wrote fails a test."""

from __future__ import annotations

import math

import pytest
import torch

from gem_kernels.hstu_gap_grad_rows import ROWS_PER_PROGRAM, silu_grad_rows
from gem_kernels.hstu_gap_saved import silu_quantize_rows
from gem_kernels.hstu_gap_triton import hstu_gap_triton, silu_columns
from gem_kernels.quantized_rows_triton import RowsOut
from gem_kernels.testing import assert_rows_stand_for, offsets_from_lengths
from gem_model.api import GradRowsSlot, PrequantizedRows, RowQuantization

pytestmark = pytest.mark.usefixtures("poison")

HV, HQ = 24, 16  # v and u columns 24 wide, q and k 16: W = 80, not a power of two (the tile's tail is masked)
WIDTH = 2 * HV + 2 * HQ
Q_COLS = slice(2 * HV, 2 * HV + HQ)


def plain_passes(pre, d_pre, dq, scale_inv=None) -> torch.Tensor:
    """What the gap's in-place passes make of ``d_pre``: v, k (and q, or q from the accumulator) times silu'."""
    out = d_pre.clone()
    if dq is not None:
        silu_columns(pre[:, Q_COLS], out[:, Q_COLS], grad=dq, scale_inv=scale_inv)
        cols = [slice(HV, 2 * HV), slice(2 * HV + HQ, WIDTH)]
    else:
        cols = [slice(HV, WIDTH)]
    for c in cols:
        silu_columns(pre[:, c], out[:, c], grad=out[:, c].clone(), scale_inv=scale_inv)
    return out


@pytest.mark.parametrize("with_dq", [True, False], ids=["dq_accumulator", "dq_in_place"])
@pytest.mark.parametrize("rows", [1, 2 * ROWS_PER_PROGRAM + 3])  # one short program; three, the last one short
def test_whole_rows_pass_writes_the_plain_passes_gradient_its_rows_and_sums(gen, rows, with_dq):
    pre = (torch.randn(rows, WIDTH, generator=gen) * 2).bfloat16()
    d_pre = torch.randn(rows, WIDTH, generator=gen).bfloat16()
    dq = torch.randn(rows, HQ, generator=gen) if with_dq else None  # float32, as the atomic accumulator
    want = plain_passes(pre, d_pre, dq)
    if with_dq:
        d_pre[:, Q_COLS] = float("nan")  # never read: the accumulator stands for these columns
    out = RowsOut.allocate(rows, WIDTH, pre.device, RowQuantization())
    sums = silu_grad_rows(pre, d_pre, HV, out, dq=None if dq is None else (dq, Q_COLS), col_sum=True)
    assert torch.equal(d_pre, want)
    assert_rows_stand_for(out.result(), want)
    torch.testing.assert_close(sums, want.double().sum(0).float(), rtol=1e-6, atol=1e-5)
    assert silu_grad_rows(pre, d_pre.clone(), HV, out, dq=None if dq is None else (dq, Q_COLS)) is None


def test_whole_rows_pass_reads_pre_from_its_e4m3_rows(gen):
    pre = (torch.randn(21, WIDTH, generator=gen) * 2).bfloat16()
    data, scale_inv = silu_quantize_rows(pre, torch.empty(21, WIDTH - HV, dtype=torch.bfloat16), HV)
    d_pre = torch.randn(21, WIDTH, generator=gen).bfloat16()
    dq = torch.randn(21, HQ, generator=gen)
    want = plain_passes(data, d_pre, dq, scale_inv=scale_inv)
    out = RowsOut.allocate(21, WIDTH, pre.device, RowQuantization())
    silu_grad_rows(data, d_pre, HV, out, dq=(dq, Q_COLS), scale_inv=scale_inv)
    assert torch.equal(d_pre, want)
    assert_rows_stand_for(out.result(), want)


def test_a_row_with_a_nan_or_an_infinity_is_all_nan_bytes(gen):
    pre = torch.randn(5, WIDTH, generator=gen).bfloat16()
    d_pre = torch.randn(5, WIDTH, generator=gen).bfloat16()
    d_pre[1, 3] = float("nan")  # a u column, read as stored
    d_pre[3, HV + 2] = float("inf")  # a v column: inf * silu' is inf (or NaN)
    d_pre[4] = 0  # a row of zeros
    out = RowsOut.allocate(5, WIDTH, pre.device, RowQuantization())
    silu_grad_rows(pre, d_pre, HV, out)
    data, scale_inv = out.data, out.scale_inv
    for row in (1, 3):
        assert (data[row] == RowQuantization.NAN_BYTE).all() and scale_inv[row].isnan()
    assert (data[4] & 0x7F == 0).all() and scale_inv[4].isfinite()  # zeros (-0 where silu' < 0)
    assert_rows_stand_for(PrequantizedRows(data[[0, 2]].view(RowQuantization.DTYPE), scale_inv[[0, 2]]), d_pre[[0, 2]])


def test_bad_arguments_are_named(gen):
    pre = torch.randn(4, WIDTH, generator=gen).bfloat16()
    out = RowsOut.allocate(4, WIDTH, pre.device, RowQuantization())
    with pytest.raises(ValueError, match="same shape"):
        silu_grad_rows(pre, torch.zeros(4, WIDTH + 1, dtype=torch.bfloat16), HV, out)
    with pytest.raises(ValueError, match="without column maxima"):
        silu_grad_rows(pre, pre.clone(), HV, RowsOut.allocate(4, WIDTH, pre.device, RowQuantization(column_amax=True)))
    with pytest.raises(TypeError, match="GradRowsSlot"):
        hstu_gap_triton(torch.zeros(3, 64), torch.ones(16), torch.zeros(16), offsets_from_lengths([3]), num_heads=1,
                        attention_dim=16, value_dim=16, max_seq_len=4, alpha=0.25, eps=1e-6, grad_rows=object())  # fmt: skip


@pytest.mark.parametrize(
    ("dq_mode", "column_sum", "saved_format"),
    [("atomic", True, None), ("separate", False, None), ("separate", True, "e4m3_row"), ("atomic", False, "e4m3_row")],
)
def test_the_gap_offers_its_gradients_rows_and_its_gradients_are_unchanged(gen, dq_mode, column_sum, saved_format):
    heads, dqk, dv = 2, 16, 16
    offsets = offsets_from_lengths([5, 0, 9])
    pre = (torch.randn(14, heads * (2 * dv + 2 * dqk), generator=gen) * 2).bfloat16()
    weight, bias = 1 + 0.1 * torch.randn(heads * dv, generator=gen), 0.1 * torch.randn(heads * dv, generator=gen)
    dy = torch.randn(14, heads * dv, generator=gen).bfloat16()
    results = []
    for slot in (None, GradRowsSlot(column_sum=column_sum)):
        leaves = [t.clone().requires_grad_() for t in (pre, weight, bias)]
        y, _ = hstu_gap_triton(*leaves, offsets, num_heads=heads, attention_dim=dqk, value_dim=dv, max_seq_len=16,
                               alpha=1 / math.sqrt(dqk), eps=1e-6, dq_mode=dq_mode, grad_rows=slot, saved_format=saved_format)  # fmt: skip
        results.append((y, slot, torch.autograd.grad(y, leaves, dy)))
    (y, _, grads), (y_s, slot, grads_s) = results
    assert torch.equal(y_s, y) and all(torch.equal(a, b) for a, b in zip(grads_s, grads))
    offered = slot.take(grads_s[0])  # autograd handed the gap's d_pre on as the leaf's gradient, unchanged
    assert offered is not None
    assert_rows_stand_for(offered.rows, grads[0])
    if column_sum:
        torch.testing.assert_close(offered.column_sum, grads[0].double().sum(0).float(), rtol=1e-6, atol=1e-5)
    else:
        assert offered.column_sum is None


@pytest.mark.parametrize("with_dq", [True, False], ids=["dq_accumulator", "dq_in_place"])
def test_whole_rows_pass_without_rows_writes_the_gradient_and_its_sums(gen, with_dq):
    rows = ROWS_PER_PROGRAM + 5  # two programs, the second short
    pre = (torch.randn(rows, WIDTH, generator=gen) * 2).bfloat16()
    d_pre = torch.randn(rows, WIDTH, generator=gen).bfloat16()
    dq = torch.randn(rows, HQ, generator=gen) if with_dq else None
    want = plain_passes(pre, d_pre, dq)
    sums = silu_grad_rows(pre, d_pre, HV, None, dq=None if dq is None else (dq, Q_COLS), col_sum=True)
    assert torch.equal(d_pre, want)
    torch.testing.assert_close(sums, want.double().sum(0).float(), rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="neither rows nor column sums"):
        silu_grad_rows(pre, d_pre, HV, None)


def test_whole_rows_pass_leaves_the_u_columns_to_their_writer_when_they_are_summed_elsewhere(gen):
    rows = ROWS_PER_PROGRAM + 5  # two programs, the second short
    pre = (torch.randn(rows, WIDTH, generator=gen) * 2).bfloat16()
    d_pre = torch.randn(rows, WIDTH, generator=gen).bfloat16()
    want = plain_passes(pre, d_pre, None)
    d_pre[:, :HV] = float("nan")  # never read: the norm-gate backward wrote and summed these columns
    sums = silu_grad_rows(pre, d_pre, HV, None, col_sum=True, u_summed=True)
    assert torch.isnan(d_pre[:, :HV]).all()  # nor written
    assert torch.equal(d_pre[:, HV:], want[:, HV:])
    assert torch.equal(sums[:HV], torch.zeros(HV))
    torch.testing.assert_close(sums[HV:], want[:, HV:].double().sum(0).float(), rtol=1e-6, atol=1e-5)
    out = RowsOut.allocate(rows, WIDTH, pre.device, RowQuantization())
    with pytest.raises(ValueError, match="u_summed skips the first hv columns"):  # the rows need every column
        silu_grad_rows(pre, d_pre, HV, out, col_sum=True, u_summed=True)
