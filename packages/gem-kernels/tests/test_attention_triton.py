"""The Triton jagged attention (forward and all three gradients) against the float64 reference.

Runs in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so grids stay tiny. Every test
poisons fresh memory with NaN: an output or gradient element the kernels never wrote fails it.
"""

from __future__ import annotations

import math

import pytest
import torch

from gem_kernels import attention_triton, attention_triton_bwd, attention_triton_common
from gem_kernels.attention import TritonJaggedAttention
from gem_kernels.attention_triton_common import tma_loads
from gem_kernels.testing import attention_errors, offsets_from_lengths, random_qkv
from gem_model.api import AttentionExtras

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}

pytestmark = pytest.mark.usefixtures("poison")


def random_lengths(gen: torch.Generator, num_seqs: int, max_len: int) -> list[int]:
    return torch.randint(0, max_len + 1, (num_seqs,), generator=gen).tolist()


def random_targets(gen: torch.Generator, lengths: list[int]) -> torch.Tensor:
    """1..5 targets, clipped to the length (as the benchmark protocol does)."""
    drawn = torch.randint(1, 6, (len(lengths),), generator=gen)
    return torch.minimum(drawn, torch.tensor(lengths))


def check(
    lengths: list[int],
    gen: torch.Generator,
    *,
    dtype: torch.dtype = torch.float32,
    dims: tuple[int, int] = (16, 16),
    heads: int = 2,
    targets: torch.Tensor | None = None,
    window: int = 0,
    config: TritonJaggedAttention.Config | None = None,
    offsets_dtype: torch.dtype = torch.int64,
    extra_len: int = 3,
) -> None:
    offsets = offsets_from_lengths(lengths, offsets_dtype)
    num_rows = int(offsets[-1])
    q, k, v = random_qkv(num_rows, heads, dims[0], dims[1], dtype, gen)
    grad_out = torch.randn(num_rows, heads, dims[1], generator=gen).to(dtype)
    kernel = TritonJaggedAttention(config)
    errors = attention_errors(
        kernel, q, k, v, offsets, grad_out,
        max_seq_len=max(lengths, default=0) + extra_len,  # N is the argument, not a length
        alpha=1.0 / math.sqrt(dims[0]),
        num_targets=None if targets is None else targets.to(offsets_dtype),
        max_attn_len=window,
    )
    context = f"lengths={lengths} targets={None if targets is None else targets.tolist()} window={window}"
    for name, error in errors.items():
        assert error < TOLERANCE[dtype], f"{name}: relative error {error:.2e} ({context})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dq", ["atomic", "separate"])
@pytest.mark.parametrize("mask", ["causal", "targets", "window_targets"])
def test_random_batches(gen: torch.Generator, dtype: torch.dtype, dq: str, mask: str) -> None:
    lengths = random_lengths(gen, 4, 40)
    targets = random_targets(gen, lengths) if mask != "causal" else None
    window = int(torch.randint(1, 24, (1,), generator=gen)) if mask == "window_targets" else 0
    dims = {"causal": (32, 32), "targets": (16, 25), "window_targets": (25, 16)}[mask]
    check(lengths, gen, dtype=dtype, dims=dims, targets=targets, window=window,
          config=TritonJaggedAttention.Config(dq=dq))


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("dims", [(32, 32), (25, 16)])
def test_atomic_dq_in_both_forms(gen: torch.Generator, monkeypatch, transposed: bool, dims: tuple[int, int]) -> None:
    """The key-major pass's dq as ``k^T ds^T`` (the default) or ``ds k``: both against the reference, with
    a head dim that is not a power of two (masked columns in the transposed atomics' addresses)."""
    monkeypatch.setattr(attention_triton_bwd, "TRANSPOSED_DQ", transposed)
    lengths = random_lengths(gen, 4, 40)
    check(lengths, gen, dtype=torch.bfloat16, dims=dims, targets=random_targets(gen, lengths), window=7,
          config=TritonJaggedAttention.Config(dq="atomic"))


@pytest.mark.parametrize("dims", [(16, 16), (25, 25), (32, 32), (64, 64), (128, 128), (256, 256), (64, 32), (32, 128)])
def test_head_dims(gen: torch.Generator, dims: tuple[int, int]) -> None:
    lengths = [9, 0, 21]
    check(lengths, gen, dims=dims, heads=1, targets=random_targets(gen, lengths), window=6)


@pytest.mark.parametrize("blocks", [(32, 16), (16, 32), (32, 32), (64, 16), (16, 64)])
def test_block_shapes(gen: torch.Generator, blocks: tuple[int, int]) -> None:
    """Full, diagonal, window-edge and target blocks line up for any BLOCK_M x BLOCK_N."""
    lengths = random_lengths(gen, 3, 70)
    config = TritonJaggedAttention.Config(block_m=blocks[0], block_n=blocks[1])
    window = int(torch.randint(1, 50, (1,), generator=gen))
    check(lengths, gen, targets=random_targets(gen, lengths), window=window, config=config)
    check(lengths, gen, config=config)


@pytest.mark.parametrize(
    ("lengths", "targets", "window"),
    [
        pytest.param([23], None, 0, id="one_sequence"),
        pytest.param([0, 0, 5, 0], [0, 0, 2, 0], 0, id="zero_lengths"),
        pytest.param([1, 1, 2, 1], None, 0, id="length_one"),
        pytest.param([6, 17], [6, 17], 0, id="all_targets"),
        pytest.param([6, 17], [6, 17], 3, id="all_targets_window"),
        pytest.param([5, 9], [7, 0], 0, id="more_targets_than_rows"),
        pytest.param([19, 4], [3, 1], 100, id="window_longer_than_sequence"),
        pytest.param([19, 18], [4, 0], 1, id="window_one"),
        pytest.param([0, 0], None, 0, id="no_rows"),
    ],
)
def test_edge_cases(gen: torch.Generator, lengths: list[int], targets: list[int] | None, window: int) -> None:
    check(lengths, gen, targets=None if targets is None else torch.tensor(targets), window=window)


def test_float16(gen: torch.Generator) -> None:
    lengths = random_lengths(gen, 3, 30)
    check(lengths, gen, dtype=torch.float16, targets=random_targets(gen, lengths), window=9)


def test_int32_offsets_and_targets(gen: torch.Generator) -> None:
    lengths = random_lengths(gen, 3, 30)
    check(lengths, gen, targets=random_targets(gen, lengths), offsets_dtype=torch.int32)


def test_strided_views_of_a_fused_projection(gen: torch.Generator) -> None:
    """q, k, v as column slices of one [L, H, 2 Dqk + Dv] tensor, as the HSTU block produces them."""
    lengths = [7, 30, 12]
    offsets = offsets_from_lengths(lengths)
    fused = torch.randn(int(offsets[-1]), 2, 2 * 16 + 25, generator=gen)
    q, k, v = fused.split([16, 16, 25], dim=-1)
    grad_out = torch.randn(v.shape, generator=gen)
    errors = attention_errors(
        TritonJaggedAttention(), q, k, v, offsets, grad_out, max_seq_len=32, alpha=0.25,
        num_targets=torch.tensor([1, 4, 2]), max_attn_len=0,
    )
    assert max(errors.values()) < 1e-5, errors


def test_queue_scan_crosses_chunks(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-kernel queue scans seq_offsets a chunk of sequences at a time; shrink the chunk to 4 so
    that a small batch crosses several chunk borders (with empty sequences on some of them)."""
    monkeypatch.setattr(attention_triton, "CHUNK", 4)
    monkeypatch.setattr(attention_triton_bwd, "CHUNK", 4)
    lengths = random_lengths(gen, 13, 20)
    lengths[3] = lengths[4] = 0
    for dq in ("atomic", "separate"):
        check(lengths, gen, targets=random_targets(gen, lengths), window=5, config=TritonJaggedAttention.Config(dq=dq))


def test_queues_reset_themselves(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The last program of every launch zeroes the work queue, so one buffer serves every launch."""
    counters: list[torch.Tensor] = []

    def counter(device: torch.device) -> torch.Tensor:
        counters.append(torch.full((2,), 0, dtype=torch.int32, device=device))
        return counters[-1]

    monkeypatch.setattr(attention_triton, "queue_counter", counter)
    monkeypatch.setattr(attention_triton_bwd, "queue_counter", counter)
    lengths = random_lengths(gen, 5, 40)
    for dq in ("atomic", "separate"):
        check(lengths, gen, targets=random_targets(gen, lengths), config=TritonJaggedAttention.Config(dq=dq))
    assert len(counters) == 5  # forward and dk/dv twice, the separate dq pass once
    assert all(c.tolist() == [0, 0] for c in counters), [c.tolist() for c in counters]


def test_forward_without_autograd_matches(gen: torch.Generator) -> None:
    """Without grad the forward kernel runs directly, skipping the autograd function."""
    from gem_kernels.attention_triton_autograd import jagged_attention_triton

    lengths = random_lengths(gen, 4, 30)
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(int(offsets[-1]), 2, 16, 16, torch.bfloat16, gen)
    targets = random_targets(gen, lengths)
    options = dict(max_seq_len=32, alpha=0.25, extras=AttentionExtras(num_targets=targets, max_attn_len=5))
    with torch.no_grad():
        direct = jagged_attention_triton(q, k, v, offsets, **options)
    tracked = jagged_attention_triton(q.requires_grad_(), k, v, offsets, **options)
    assert tracked.grad_fn is not None and direct.grad_fn is None
    assert torch.equal(direct, tracked.detach())


def test_dq_auto(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` (the default) is exact whichever pass it picks; it picks as the H200 figures say, with the
    stored ``ds`` tiles in place of the recomputing pass (``STORED_BY_DEFAULT``)."""
    from gem_kernels import attention_triton_autograd
    from gem_kernels.attention_triton_autograd import resolve_dq_mode

    lengths = random_lengths(gen, 4, 40)
    check(lengths, gen, targets=random_targets(gen, lengths), config=TritonJaggedAttention.Config())
    assert TritonJaggedAttention.Config().dq == "auto"
    # (rows, sequences, heads) of the benchmark cases whose two backward modes were timed
    assert resolve_dq_mode("auto", 39011, 512, 4) == "atomic"  # N = 256, s = 0.3
    assert resolve_dq_mode("auto", 15939, 128, 2) == "atomic"  # MovieLens-like
    assert resolve_dq_mode("auto", 124189, 512, 4) == "stored"  # N = 256, s = 0.95
    assert resolve_dq_mode("auto", 154387, 512, 4) == "stored"  # N = 1024, s = 0.3
    assert resolve_dq_mode("atomic", 10**7, 512, 4) == "atomic"
    monkeypatch.setattr(attention_triton_autograd, "STORED_BY_DEFAULT", False)
    assert resolve_dq_mode("auto", 124189, 512, 4) == "separate"


def test_tuning_keys() -> None:
    from gem_kernels.attention_triton_common import length_buckets, pow2_at_least

    assert [pow2_at_least(n) for n in (0, 1, 2, 3, 64, 65, 1000)] == [1, 1, 2, 4, 64, 128, 1024]
    assert length_buckets(1024, 498459, 512) == (1024, 1024)  # s = 0.95: mean 974
    assert length_buckets(1024, 154387, 512) == (1024, 512)  # s = 0.3: mean 302, tuned apart
    assert length_buckets(200, 15939, 128) == (256, 128)
    assert length_buckets(10, 3, 5) == (16, 16)


def test_tuning_picks_the_fastest_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuning times every candidate once per key, drops those that fail, keeps the fastest, restores
    what the timing runs accumulated into, and launches the winner; the next call only launches."""
    import triton.testing

    from gem_kernels import launcher

    slow, fast, broken = (64, 64, 4, 2, 2), (128, 64, 8, 2, 1), (128, 128, 8, 3, 1)
    times = {slow: 2.0, fast: 1.0}
    launched: list[tuple] = []

    def fake_run(self: object, config: tuple, *args: object) -> None:
        if config == broken:
            raise RuntimeError("out of resources: shared memory")
        launched.append(config)

    def fake_bench(fn: object, warmup: int, rep: int, return_mode: str) -> float:
        fn()  # type: ignore[operator]
        return times[launched[-1]]

    monkeypatch.setattr(launcher.TunedKernel, "_run", fake_run)
    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    kernel = launcher.TunedKernel(
        "probe", attention_triton.query_major_kernel, pointers=("Q", "K", "V", "DO", "OUT"),
        floats=("alpha", "out_scale"), key_names=("a", "b"),
    )
    restored: list[int] = []
    options = dict(variant=("v",), buckets=(1,), configs=[slow, broken, fast], device=torch.device("cpu"),
                   tile_bound=lambda config: 1, after_tuning=lambda: restored.append(1))
    kernel.launch((), dict, **options)  # type: ignore[arg-type]
    assert kernel.chosen[("v", 1)] == fast and launched[-1] == fast and restored == [1]
    record = kernel.records()["probe(a=v, b=1)"]
    assert record["chosen"] == launcher.config_str(fast)
    assert "out of resources" in record["trials_ms"][launcher.config_str(broken)]
    before = len(launched)
    kernel.launch((), dict, **options)  # type: ignore[arg-type]
    assert launched[before:] == [fast] and restored == [1] and kernel.last == (("v", 1), fast)


@pytest.mark.parametrize("mask", ["causal", "targets_window"])
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # tanh of the loud rows' own large scores
def test_tma_loads_give_the_pointer_loads_bits(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, mask: str) -> None:
    """Tiles by tensor descriptors read past a sequence's end into the next sequence's rows
    (zeros past the tensor's end); the masks must drop every score they make. The next rows here are
    1000x larger than the sequence's own, so a leak would show; the forward and the dq pass (the two
    kernels that read keys and values) and the dk/dv pass (queries and output gradients) must give the
    pointer loads' bits, and match the reference."""
    lengths = [5, 37, 0, 18, 3, 26]
    targets = random_targets(gen, lengths) if mask != "causal" else None
    window = 7 if mask != "causal" else 0
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(int(offsets[-1]), 2, 32, 32, torch.bfloat16, gen)
    loud = torch.zeros(int(offsets[-1]), dtype=torch.bool)
    loud[offsets[1:-1].tolist()[::2]] = True  # the first row of every other sequence after the first
    for t in (q, k, v):
        t[loud] *= 1000.0
    grad_out = torch.randn(v.shape, generator=gen).to(torch.bfloat16)
    grad_out[loud] *= 1000.0
    config = TritonJaggedAttention.Config(dq="separate", block_m=16, block_n=16)
    assert tma_loads(k, v) and tma_loads(q, grad_out)
    extras = AttentionExtras(num_targets=targets, max_attn_len=window)

    def run() -> list[torch.Tensor]:
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        out = TritonJaggedAttention(config)(*leaves, offsets, max_seq_len=40, alpha=0.25, extras=extras)
        return [out, *torch.autograd.grad(out, leaves, grad_out)]

    monkeypatch.setattr(attention_triton_bwd, "TMA_LOADS", True)  # off by default in the dk/dv pass
    with_tma = run()
    monkeypatch.setattr(attention_triton_common, "TMA_LOADS", False)
    assert not tma_loads(k, v)
    with_pointers = run()
    for name, a, b in zip(("out", "dq", "dk", "dv"), with_tma, with_pointers, strict=True):
        assert torch.equal(a, b), name
    errors = attention_errors(TritonJaggedAttention(config), q, k, v, offsets, grad_out, max_seq_len=40, alpha=0.25,
                              num_targets=targets, max_attn_len=window)
    assert max(errors.values()) < TOLERANCE[torch.bfloat16], errors


def test_tma_loads_only_where_descriptors_fit() -> None:
    """Descriptors need unpadded power-of-two head dims, heads side by side, 16-byte rows, one 16-bit dtype."""
    rows = torch.zeros(7, 2, 3 * 32, dtype=torch.bfloat16)
    k, v = rows[:, :, :32], rows[:, :, 32:64]  # heads 96 apart: not side by side
    assert not tma_loads(k, v)
    flat = torch.zeros(7, 3 * 64, dtype=torch.bfloat16)  # the uvqk layout: k and v are column slices of one row
    k, v = flat[:, 64:128].view(7, 2, 32), flat[:, 128:].view(7, 2, 32)
    assert tma_loads(k, v)
    assert not tma_loads(k.float(), v.float())
    assert not tma_loads(k, v.half())
    odd = torch.zeros(7, 2 * 25, dtype=torch.bfloat16).view(7, 2, 25)
    assert not tma_loads(odd, odd)
    shifted = torch.zeros(7 * 64 + 1, dtype=torch.bfloat16)[1:].view(7, 2, 32)  # base 2 bytes off
    assert not tma_loads(shifted, shifted)

