"""gem_model.jagged.segment_mean: the mean of each sequence's rows, by GEMM or by index_add."""

from __future__ import annotations

import pytest
import torch

from gem_model import jagged
from gem_model.jagged import segment_mean


def _reference(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """float64 means, zeros for an empty sequence."""
    out, start = [], 0
    for n in lengths.tolist():
        rows = values[start : start + n].double()
        out.append(rows.mean(0) if n else torch.zeros(values.shape[1], dtype=torch.float64))
        start += n
    return torch.stack(out)


@pytest.mark.parametrize("gemm", [True, False])
def test_means_match_float64_and_gradients_reach_each_row_from_its_sequence(gemm):
    gen = torch.Generator().manual_seed(11)
    lengths = torch.tensor([5, 0, 1, 300, 2, 0])  # empty sequences, one long one
    values = (torch.randn(int(lengths.sum()), 16, generator=gen) * 3 + 1).bfloat16().requires_grad_()
    mean = segment_mean(values, lengths, gemm=gemm)
    assert mean.dtype == torch.bfloat16 and mean.shape == (6, 16)
    want = _reference(values.detach(), lengths)
    # float32 sums of bf16 values, one rounding to bf16 at the end: within a bf16 step of the exact mean
    torch.testing.assert_close(mean.double(), want, rtol=2**-8, atol=1e-6)
    assert torch.all(mean[1] == 0) and torch.all(mean[5] == 0)
    grad = torch.randn(6, 16, generator=gen).bfloat16()
    mean.backward(grad)
    owner = torch.repeat_interleave(torch.arange(6), lengths)
    per_row = (grad.float() / lengths.clamp(min=1)[:, None]).bfloat16()[owner]  # as autograd's division gives it
    torch.testing.assert_close(values.grad, per_row, rtol=0, atol=0)


def test_gemm_and_index_add_agree_and_the_size_limit_picks_index_add(monkeypatch):
    gen = torch.Generator().manual_seed(12)
    lengths = torch.randint(0, 40, (9,), generator=gen)
    values = torch.randn(int(lengths.sum()), 8, generator=gen).bfloat16()
    torch.testing.assert_close(segment_mean(values, lengths, gemm=True), segment_mean(values, lengths, gemm=False),
                               rtol=2**-8, atol=1e-6)  # fmt: skip
    calls = []
    monkeypatch.setattr(jagged._SegmentSum, "apply", lambda *a: calls.append(a) or torch.zeros(9, 8))
    segment_mean(values, lengths)  # on the CPU the default is index_add
    assert not calls
    monkeypatch.setattr(jagged, "MEMBERSHIP_GEMM_ELEMENTS", 0)
    segment_mean(values, lengths, gemm=None)
    assert not calls
    segment_mean(values, lengths, gemm=True)
    assert len(calls) == 1


def test_float32_values_are_summed_by_index_add_bit_for_bit():
    gen = torch.Generator().manual_seed(13)
    lengths = torch.tensor([3, 7, 0, 4])
    values = torch.randn(14, 5, generator=gen)
    owner = torch.repeat_interleave(torch.arange(4), lengths)
    want = torch.zeros(4, 5).index_add(0, owner, values) / lengths.clamp(min=1)[:, None]
    assert torch.equal(segment_mean(values, lengths, gemm=True), want)
