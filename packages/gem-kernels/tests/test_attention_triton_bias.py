"""The Triton jagged attention with HSTU's relative biases against the torch kernel (run in float64).

Forward output and the gradients of q, k, v, ``position_bias`` and ``time_bias``, on fresh random
inputs, in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so grids stay tiny. Every test
poisons fresh memory with NaN: an output or gradient element the kernels never wrote fails it (the
bias gradients are sums into zeroed buffers: a missed pair shows as a wrong sum). Tolerances are
relative Frobenius errors: 1e-5 for float32 inputs, 1e-2 for bfloat16 (as ``test_attention_triton``).
"""

from __future__ import annotations

import math

import pytest
import torch

from gem_kernels import attention_triton, attention_triton_bwd
from gem_kernels.attention import TritonJaggedAttention
from gem_kernels.attention_torch import jagged_attention_torch
from gem_kernels.attention_triton_bias import bucket_edges, time_buckets_triton
from gem_kernels.testing import offsets_from_lengths, random_qkv, relative_error
from gem_model.api import AttentionExtras
from gem_model.jagged import time_buckets

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
BIAS_GRAD_TOLERANCE = {torch.float32: 5e-5, torch.bfloat16: 1e-2}
"""For the bias tables' gradients: each entry is a float32 sum over every pair at one relative position
or time bucket, with cancellation, and the relative error is over a table with few nonzero entries. With
every row a target and a window of 3 ([6, 17]) it reached 9.6e-6 over 120 seeds and 1.47e-5 at
GEM_KERNELS_TEST_SEED=792311687 (a CI run); q, k, v's gradients stay within 3e-7 on the same cases."""
BIASES = {"position": ("position",), "time": ("time",), "both": ("position", "time")}

pytestmark = pytest.mark.usefixtures("poison")


def random_lengths(gen: torch.Generator, num_seqs: int, max_len: int) -> list[int]:
    return torch.randint(0, max_len + 1, (num_seqs,), generator=gen).tolist()


def random_targets(gen: torch.Generator, lengths: list[int]) -> torch.Tensor:
    return torch.minimum(torch.randint(1, 6, (len(lengths),), generator=gen), torch.tensor(lengths))


def random_times(gen: torch.Generator, num_rows: int, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``sorted``: rating-like times (bursts seconds apart, gaps of hours to months), each query at the
    next row's time or later, so a row of a tile mostly stays in one or two buckets. ``random``:
    unordered times over ~30 years, both signs of the difference and many buckets in every row
    (the per-pair atomics of the time gradient)."""
    if kind == "random":
        times = torch.randint(0, 10**9, (num_rows,), generator=gen)
        return times, torch.randint(0, 10**9, (num_rows,), generator=gen)
    burst = torch.rand(num_rows, generator=gen) < 0.15
    gaps = torch.where(burst, torch.randint(10**4, 10**7, (num_rows,), generator=gen),
                       torch.randint(0, 120, (num_rows,), generator=gen))
    times = 1_700_000_000 + torch.cumsum(gaps, 0)
    return times, times + torch.randint(0, 600, (num_rows,), generator=gen)


def check(
    lengths: list[int],
    gen: torch.Generator,
    *,
    biases: tuple[str, ...],
    dtype: torch.dtype = torch.float32,
    bias_dtype: torch.dtype = torch.float32,
    dims: tuple[int, int] = (16, 16),
    heads: int = 2,
    targets: torch.Tensor | None = None,
    window: int = 0,
    config: TritonJaggedAttention.Config | None = None,
    times: str = "sorted",
    num_buckets: int = 40,
    extra_len: int = 3,
) -> dict[str, float]:
    offsets = offsets_from_lengths(lengths)
    num_rows = int(offsets[-1])
    max_seq_len = max(lengths, default=0) + extra_len  # N is the argument, not a length
    q, k, v = random_qkv(num_rows, heads, dims[0], dims[1], dtype, gen)
    grad_out = torch.randn(num_rows, heads, dims[1], generator=gen).to(dtype)
    tables: dict[str, torch.Tensor] = {}
    if "position" in biases:
        tables["position_bias"] = (0.5 * torch.randn(2 * max_seq_len - 1, generator=gen)).to(bias_dtype)
    stamps: dict[str, torch.Tensor] = {}
    if "time" in biases:
        tables["time_bias"] = (0.5 * torch.randn(num_buckets, generator=gen)).to(bias_dtype)
        stamps["timestamps"], stamps["query_timestamps"] = random_times(gen, num_rows, times)
    options = dict(max_seq_len=max_seq_len, alpha=1.0 / math.sqrt(dims[0]))
    masks = dict(max_attn_len=window, num_targets=targets)

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, *tables.values())]
    named = dict(zip(tables, leaves[3:], strict=True))
    out = TritonJaggedAttention(config)(*leaves[:3], offsets, **options,
                                        extras=AttentionExtras(**masks, **named, **stamps))
    grads = torch.autograd.grad(out, leaves, grad_out)
    exact = [t.detach().double().requires_grad_() for t in leaves]
    expected = jagged_attention_torch(*exact[:3], offsets, **options, extras=AttentionExtras(
        **masks, **dict(zip(tables, exact[3:], strict=True)), **stamps))
    expected_grads = [g if g is not None else torch.zeros_like(t) for g, t in  # no rows: no graph
                      zip(torch.autograd.grad(expected, exact, grad_out.double(), allow_unused=True), exact)]

    names = ["out", "dq", "dk", "dv", *(f"d{name}" for name in tables)]
    errors = {name: relative_error(got, want) for name, got, want in
              zip(names, [out, *grads], [expected, *expected_grads], strict=True)}
    context = (f"lengths={lengths} targets={None if targets is None else targets.tolist()} window={window} "
               f"biases={biases} times={times}")
    for name, error in errors.items():
        tolerance = (BIAS_GRAD_TOLERANCE if name.endswith("_bias") else TOLERANCE)[dtype]
        assert error < tolerance, f"{name}: relative error {error:.2e} ({context})"
    for leaf, grad in zip(leaves[3:], grads[3:], strict=True):
        assert grad.dtype == leaf.dtype, (grad.dtype, leaf.dtype)
    return errors


@pytest.mark.parametrize("bias", list(BIASES))
@pytest.mark.parametrize("mask", ["causal", "targets", "window_targets"])
def test_random_batches(gen: torch.Generator, bias: str, mask: str) -> None:
    lengths = random_lengths(gen, 4, 40)
    targets = random_targets(gen, lengths) if mask != "causal" else None
    window = int(torch.randint(1, 24, (1,), generator=gen)) if mask == "window_targets" else 0
    dq = "separate" if mask == "targets" else "atomic"  # both dq passes see every bias
    check(lengths, gen, biases=BIASES[bias], targets=targets, window=window,
          config=TritonJaggedAttention.Config(dq=dq))


@pytest.mark.parametrize("bias_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16(gen: torch.Generator, bias_dtype: torch.dtype) -> None:
    """bf16 q, k, v with fp32 tables (the model's case) or bf16 ones; the gradients come back in the
    tables' own dtype."""
    lengths = random_lengths(gen, 3, 40)
    check(lengths, gen, biases=BIASES["both"], dtype=torch.bfloat16, bias_dtype=bias_dtype,
          targets=random_targets(gen, lengths), window=9, dims=(32, 32))


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32)])
def test_block_shapes(gen: torch.Generator, blocks: tuple[int, int]) -> None:
    """The tile's diagonal sums shear along keys (BLOCK_N >= BLOCK_M) or along queries (BLOCK_M > BLOCK_N)."""
    lengths = random_lengths(gen, 3, 70)
    config = TritonJaggedAttention.Config(block_m=blocks[0], block_n=blocks[1])
    check(lengths, gen, biases=BIASES["both"], targets=random_targets(gen, lengths),
          window=int(torch.randint(1, 50, (1,), generator=gen)), config=config)


@pytest.mark.parametrize("dq", ["atomic", "separate"])
def test_unordered_times(gen: torch.Generator, dq: str) -> None:
    """Times in no order: negative differences, and rows of a tile spread over many buckets."""
    lengths = random_lengths(gen, 3, 40)
    check(lengths, gen, biases=BIASES["time"], times="random", num_buckets=128,
          config=TritonJaggedAttention.Config(dq=dq))


@pytest.mark.parametrize(
    ("lengths", "targets", "window"),
    [
        pytest.param([0, 0, 5, 0], [0, 0, 2, 0], 0, id="zero_lengths"),
        pytest.param([1, 1, 2, 1], None, 0, id="length_one"),
        pytest.param([6, 17], [6, 17], 3, id="all_targets_window"),
        pytest.param([19, 4], [3, 1], 100, id="window_longer_than_sequence"),
        pytest.param([0, 0], None, 0, id="no_rows"),
    ],
)
def test_edge_cases(gen: torch.Generator, lengths: list[int], targets: list[int] | None, window: int) -> None:
    check(lengths, gen, biases=BIASES["both"], targets=None if targets is None else torch.tensor(targets),
          window=window, extra_len=0 if lengths == [19, 4] else 3)


def test_queue_scan_crosses_chunks(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequence starts come from the chunked queue scan: timestamps and positions must follow them."""
    monkeypatch.setattr(attention_triton, "CHUNK", 4)
    monkeypatch.setattr(attention_triton_bwd, "CHUNK", 4)
    lengths = random_lengths(gen, 9, 16)
    lengths[3] = 0
    check(lengths, gen, biases=BIASES["both"], targets=random_targets(gen, lengths), window=5, heads=1)


def test_time_buckets_match_torch_at_every_edge(gen: torch.Generator) -> None:
    """The kernels' bucket (a float32 estimate settled by the edge table near an edge) equals the
    float64 torch function on both sides of every edge, at 0 and +-1, on huge differences and on
    random ones, where a plain float32 log disagrees (checked here too, so the table stays needed)."""
    for num_buckets in (1, 2, 40, 128, 150):
        edges = bucket_edges(num_buckets, torch.device("cpu"))
        wanted = torch.arange(num_buckets + 1)
        reachable = edges < 2**63 - 1  # past the bucket of the largest int64: a sentinel
        assert (time_buckets(edges[reachable], 2**62) >= wanted[reachable]).all()
        assert (time_buckets(edges[reachable][1:] - 1, 2**62) < wanted[reachable][1:]).all()  # the smallest such
        assert (time_buckets(torch.tensor([2**63 - 1]), 2**62) < wanted[~reachable]).all()
        capped = edges.clamp(max=2**62)
        near = torch.cat([capped + shift for shift in (-2, -1, 0, 1)])
        dt = torch.cat([near, -near, torch.tensor([0, 1, -1, 2, -2, 3, 2**62, -(2**62)]),
                        torch.randint(-(2**45), 2**45, (4000,), generator=gen),
                        torch.randint(-(10**6), 10**6, (4000,), generator=gen)])
        got = time_buckets_triton(dt, num_buckets).long()
        want = time_buckets(dt, num_buckets)
        assert torch.equal(got, want), (num_buckets, dt[got != want][:8].tolist(), got[got != want][:8].tolist())
    edges = bucket_edges(128, torch.device("cpu"))[1:80]
    near = torch.cat([edges - 1, edges, edges + 1])
    plain = (torch.log(near.float()) / 0.301).floor().long()
    assert (plain != time_buckets(near, 128)).sum() > 10  # a float32 log alone gets many of them wrong


def test_gradients_only_for_tables_that_want_them(gen: torch.Generator) -> None:
    """A frozen table gets no gradient (nor its kernel work), the other still does; without autograd
    the forward kernel runs directly and gives the same output."""
    lengths = [9, 30, 14]
    offsets = offsets_from_lengths(lengths)
    rows, n = int(offsets[-1]), 32
    q, k, v = random_qkv(rows, 2, 16, 16, torch.float32, gen)
    position_bias = torch.randn(2 * n - 1, generator=gen)
    time_bias = torch.randn(16, generator=gen, requires_grad=True)
    times, query_times = random_times(gen, rows, "sorted")
    kernel = TritonJaggedAttention()
    options = dict(num_targets=torch.tensor([1, 3, 2]), position_bias=position_bias,
                   time_bias=time_bias, timestamps=times.to(torch.int32) - 1_700_000_000,  # int32 times too
                   query_timestamps=query_times - 1_700_000_000)
    out = kernel(q, k, v, offsets, max_seq_len=n, alpha=0.25, extras=AttentionExtras(**options))
    (d_time,) = torch.autograd.grad(out, [time_bias], torch.ones_like(out))
    exact = {**options, "time_bias": time_bias.detach().double().requires_grad_(),
             "position_bias": position_bias.double()}
    expected = jagged_attention_torch(q.double(), k.double(), v.double(), offsets, max_seq_len=n, alpha=0.25,
                                      extras=AttentionExtras(**exact))
    (want,) = torch.autograd.grad(expected, [exact["time_bias"]], torch.ones_like(expected))
    assert relative_error(out, expected) < 1e-5 and relative_error(d_time, want) < 1e-5
    with torch.no_grad():
        direct = kernel(q, k, v, offsets, max_seq_len=n, alpha=0.25, extras=AttentionExtras(**options))
    assert torch.equal(direct, out.detach())
    labels = [key[5] for key, _ in (attention_triton.FORWARD.last, attention_triton_bwd.DKDV_ATOMIC.last)]
    assert labels == ["position+time", "position+time'"], labels  # the frozen table's gradient is not computed


def test_inputs_are_checked(gen: torch.Generator) -> None:
    q, k, v = random_qkv(10, 1, 16, 16, torch.float32, gen)
    offsets, times = torch.tensor([0, 10]), torch.arange(10)
    kernel = TritonJaggedAttention()
    call = {"max_seq_len": 10, "alpha": 1.0}
    assert TritonJaggedAttention.supports_position_bias and TritonJaggedAttention.supports_time_bias
    with pytest.raises(ValueError, match=r"position_bias must be \[2 \* max_seq_len - 1\] = \[19\]"):
        kernel(q, k, v, offsets, **call, extras=AttentionExtras(position_bias=torch.zeros(10)))
    with pytest.raises(ValueError, match="time_bias, timestamps and query_timestamps come together"):
        kernel(q, k, v, offsets, **call, extras=AttentionExtras(time_bias=torch.zeros(8), timestamps=times))
    with pytest.raises(ValueError, match=r"timestamps must be integer \[L\] = \[10\], got torch.float32"):
        kernel(q, k, v, offsets, **call,
               extras=AttentionExtras(time_bias=torch.zeros(8), timestamps=times.float(), query_timestamps=times))
    with pytest.raises(ValueError, match="time_bias must be floating point"):
        kernel(q, k, v, offsets, **call, extras=AttentionExtras(time_bias=torch.zeros(8, dtype=torch.int64),
                                                                timestamps=times, query_timestamps=times))
