"""The bucketed pure-torch kernel (the CPU default) against the reference."""

from __future__ import annotations

import pytest
import torch

from gem_kernels.attention import TorchJaggedAttention
from gem_kernels.attention_torch import BUCKET_GROWTH, SMALL_BUCKET, plan_buckets
from gem_kernels.reference import jagged_attention_reference
from gem_kernels.testing import attention_errors, offsets_from_lengths, random_qkv
from gem_model.api import AttentionExtras

pytestmark = pytest.mark.usefixtures("poison")


def test_buckets_cover_every_sequence_once_and_pad_little(gen: torch.Generator) -> None:
    lengths = torch.randint(0, 300, (200,), generator=gen).tolist()
    buckets = plan_buckets(lengths)
    seen = [b for _, seqs in buckets for b in seqs]
    assert sorted(seen) == [b for b, n in enumerate(lengths) if n > 0]
    for size, seqs in buckets:
        assert size == max(lengths[b] for b in seqs)
        assert size <= SMALL_BUCKET or all(lengths[b] * BUCKET_GROWTH >= size for b in seqs)


def test_short_sequences_are_not_padded_to_the_longest() -> None:
    assert plan_buckets([1000, 3, 4, 2]) == [(1000, [0]), (4, [2, 1, 3])]


@pytest.mark.parametrize(
    ("dtype", "tolerance"), [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 1e-2)]
)
@pytest.mark.parametrize("window", [0, 5])
def test_matches_reference(gen: torch.Generator, dtype: torch.dtype, tolerance: float, window: int) -> None:
    lengths = torch.randint(0, 60, (9,), generator=gen).tolist()
    targets = torch.minimum(torch.randint(0, 6, (9,), generator=gen), torch.tensor(lengths))
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(int(offsets[-1]), 2, 25, 16, dtype, gen)
    grad_out = torch.randn(v.shape, generator=gen).to(dtype)
    errors = attention_errors(
        TorchJaggedAttention(), q, k, v, offsets, grad_out, max_seq_len=64, alpha=0.2, num_targets=targets,
        max_attn_len=window,
    )
    assert max(errors.values()) < tolerance, errors


@pytest.mark.parametrize(
    ("lengths", "targets"),
    [([23], None), ([0, 0, 5, 0], [0, 0, 5, 0]), ([1, 1, 2], None), ([5, 9], [7, 0]), ([0, 0], None)],
)
def test_edge_cases(gen: torch.Generator, lengths: list[int], targets: list[int] | None) -> None:
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(int(offsets[-1]), 1, 16, 16, torch.float64, gen)
    errors = attention_errors(
        TorchJaggedAttention(), q, k, v, offsets, torch.randn(v.shape, generator=gen, dtype=torch.float64),
        max_seq_len=30, alpha=0.5, num_targets=None if targets is None else torch.tensor(targets), max_attn_len=3,
    )
    assert max(errors.values()) < 1e-12, errors


def test_rejects_mismatched_shapes() -> None:
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="v must be"):
        TorchJaggedAttention()(q, q, torch.zeros(4, 3, 8), torch.tensor([0, 4]), max_seq_len=4, alpha=1.0)
    with pytest.raises(ValueError, match="num_targets"):
        TorchJaggedAttention()(q, q, q, torch.tensor([0, 4]), max_seq_len=4, alpha=1.0,
                               extras=AttentionExtras(num_targets=torch.ones(2)))


def test_relative_position_bias_matches_the_reference_and_a_direct_loop(gen: torch.Generator) -> None:
    """Forward and every gradient, the bias's included, against the padded reference; the reference
    itself against the formula written out per (i, j)."""
    lengths = [7, 0, 30, 3, 12]
    offsets = offsets_from_lengths(lengths)
    n_max = 32
    q, k, v = random_qkv(int(offsets[-1]), 2, 8, 8, torch.float64, gen)
    bias = torch.randn(2 * n_max - 1, generator=gen, dtype=torch.float64)
    targets = torch.tensor([2, 0, 0, 1, 4])
    grad_out = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    got, want = [], []
    for fn, out in ((TorchJaggedAttention(), got), (jagged_attention_reference, want)):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, bias)]
        y = fn(*leaves[:3], offsets, max_seq_len=n_max, alpha=0.3,
               extras=AttentionExtras(num_targets=targets, position_bias=leaves[3]))
        y.backward(grad_out)
        out.extend([y.detach(), *(t.grad for t in leaves)])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert want[4].abs().sum() > 0  # the bias is trained
    # sequence 2 (30 rows, no targets): row i attends to j <= i with the bias of j - i
    s = int(offsets[2])
    for i in (0, 17, 29):
        expected = sum(
            torch.nn.functional.silu(0.3 * (q[s + i] * k[s + j]).sum(-1) + bias[j - i + n_max - 1])[:, None] / n_max * v[s + j]
            for j in range(i + 1)
        )
        torch.testing.assert_close(want[0][s + i], expected, rtol=1e-10, atol=1e-12)


def test_relative_position_bias_shape_is_checked(gen: torch.Generator) -> None:
    q, k, v = random_qkv(10, 1, 4, 4, torch.float32, gen)
    with pytest.raises(ValueError, match=r"position_bias must be \[2 \* max_seq_len - 1\] = \[19\]"):
        TorchJaggedAttention()(q, k, v, torch.tensor([0, 10]), max_seq_len=10, alpha=1.0,
                               extras=AttentionExtras(position_bias=torch.zeros(10)))
    assert TorchJaggedAttention.supports_position_bias  # triton's: test_attention_triton_bias.py


def test_time_bias_matches_the_reference_the_loop_kernel_and_the_formula(gen: torch.Generator) -> None:
    """Time and position bias together, with targets: forward and every gradient (both biases included)
    of the bucketed kernel and the loop kernel against the padded reference; the reference against
    the formula written out per (i, j) on one sequence."""
    from gem_model.jagged import time_buckets
    from gem_model.testing import LoopAttention

    lengths = [7, 0, 30, 3, 12]
    offsets = offsets_from_lengths(lengths)
    n_max, rows = 32, int(offsets[-1])
    q, k, v = random_qkv(rows, 2, 8, 8, torch.float64, gen)
    position_bias = torch.randn(2 * n_max - 1, generator=gen, dtype=torch.float64)
    time_bias = torch.randn(40, generator=gen, dtype=torch.float64)
    # keys: increasing times with gaps from 0 s to ~10 days; queries: the next row's time or later
    times = torch.cumsum(torch.randint(0, 10**6, (rows,), generator=gen), 0)
    query_times = times + torch.randint(0, 10**5, (rows,), generator=gen)
    targets = torch.tensor([2, 0, 0, 1, 4])
    grad_out = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    results = []
    for fn in (jagged_attention_reference, TorchJaggedAttention(), LoopAttention()):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, position_bias, time_bias)]
        y = fn(*leaves[:3], offsets, max_seq_len=n_max, alpha=0.3, extras=AttentionExtras(
               num_targets=targets, position_bias=leaves[3], time_bias=leaves[4], timestamps=times,
               query_timestamps=query_times))
        y.backward(grad_out)
        results.append([y.detach(), *(t.grad for t in leaves)])
    for other in results[1:]:
        for a, b in zip(other, results[0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    used = time_buckets(query_times[:, None] - times[None, :], 40).unique()
    assert used.numel() > 5 and results[0][5].abs().sum() > 0  # many buckets in play, the time bias is trained
    s = int(offsets[2])  # sequence 2: 30 rows, no targets
    for i in (0, 11, 29):
        expected = sum(
            torch.nn.functional.silu(
                0.3 * (q[s + i] * k[s + j]).sum(-1)
                + position_bias[j - i + n_max - 1]
                + time_bias[time_buckets(query_times[s + i] - times[s + j], 40)]
            )[:, None] / n_max * v[s + j]
            for j in range(i + 1)
        )
        torch.testing.assert_close(results[0][0][s + i], expected, rtol=1e-10, atol=1e-12)


def test_time_buckets_on_known_differences() -> None:
    from gem_model.jagged import time_buckets

    dt = torch.tensor([0, 1, -1, 2, 100, -100, 86_400, 10**12])
    # ln(2) / 0.301 = 2.30, ln(100) / 0.301 = 15.3, ln(86400) / 0.301 = 37.8, ln(1e12) / 0.301 = 91.8
    assert time_buckets(dt, 128).tolist() == [0, 0, 0, 2, 15, 15, 37, 91]
    assert time_buckets(dt, 20).tolist() == [0, 0, 0, 2, 15, 15, 19, 19]


def test_time_bias_inputs_are_checked(gen: torch.Generator) -> None:
    q, k, v = random_qkv(10, 1, 4, 4, torch.float32, gen)
    offsets, ts = torch.tensor([0, 10]), torch.arange(10)
    attn = TorchJaggedAttention()
    call = {"max_seq_len": 10, "alpha": 1.0}
    with pytest.raises(ValueError, match="time_bias, timestamps and query_timestamps come together"):
        attn(q, k, v, offsets, **call, extras=AttentionExtras(time_bias=torch.zeros(8), timestamps=ts))
    with pytest.raises(ValueError, match=r"query_timestamps must be integer \[L\] = \[10\], got torch.float32"):
        attn(q, k, v, offsets, **call, extras=AttentionExtras(time_bias=torch.zeros(8), timestamps=ts,
                                                              query_timestamps=ts.float()))
    with pytest.raises(ValueError, match=r"timestamps must be integer \[L\] = \[10\], got torch.int64 \(9,\)"):
        attn(q, k, v, offsets, **call, extras=AttentionExtras(time_bias=torch.zeros(8), timestamps=ts[:9],
                                                              query_timestamps=ts))
    with pytest.raises(ValueError, match="time_bias must be a non-empty"):
        attn(q, k, v, offsets, **call, extras=AttentionExtras(time_bias=torch.zeros(2, 4), timestamps=ts,
                                                              query_timestamps=ts))
    assert TorchJaggedAttention.supports_time_bias


def test_layout_cache_reuses_a_layout_only_for_the_same_unmodified_inputs(gen: torch.Generator, monkeypatch) -> None:
    """The blocks of a model call the kernel with the same offsets: planned once. A new offsets
    tensor, or the same one changed in place, is planned again, and every result matches the reference."""
    from gem_kernels import attention_torch

    plans = []
    real = attention_torch.plan_layout
    monkeypatch.setattr(attention_torch, "plan_layout", lambda *a: plans.append(1) or real(*a))
    times = []
    real_times = attention_torch.time_index
    monkeypatch.setattr(attention_torch, "time_index", lambda *a: times.append(1) or real_times(*a))
    attn = TorchJaggedAttention()
    lengths = [9, 0, 4, 13]
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(26, 2, 4, 4, torch.float64, gen)
    stamps = torch.cumsum(torch.randint(0, 10**5, (26,), generator=gen), 0)
    bias = {"time_bias": torch.randn(30, generator=gen, dtype=torch.float64), "timestamps": stamps,
            "query_timestamps": stamps + 7}

    def check(offsets: torch.Tensor, **kw) -> None:
        got = attn(q, k, v, offsets, max_seq_len=16, alpha=0.5, extras=AttentionExtras(**kw))
        want = jagged_attention_reference(q, k, v, offsets, max_seq_len=16, alpha=0.5, extras=AttentionExtras(**kw))
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)

    for _ in range(3):  # three "blocks"
        check(offsets, **bias)
    assert len(plans) == 1 and len(times) == 1
    stamps[:5] += 10**6  # the times change in place: new time buckets, same layout
    check(offsets, **bias)
    assert len(plans) == 1 and len(times) == 2
    offsets[1:] = offsets_from_lengths([3, 6, 4, 13])[1:]  # the offsets change in place
    check(offsets)
    assert len(plans) == 2
    check(offsets_from_lengths([20, 0, 3, 3]))  # another tensor
    assert len(plans) == 3
    check(offsets_from_lengths([9, 0, 4, 13]), num_targets=torch.tensor([2, 0, 1, 3]))
    check(offsets_from_lengths([9, 0, 4, 13]), num_targets=torch.tensor([2, 0, 1, 3]), max_attn_len=3)
    assert len(plans) == 5
