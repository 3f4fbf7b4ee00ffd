"""``dq_mode="stored"``: the dk/dv pass stores the score gradients, the dq pass reads them back
(gem_kernels.attention_triton_stored). Under Triton's interpreter, on poisoned memory."""

from __future__ import annotations

import math

import pytest
import torch

from gem_kernels import attention_triton, attention_triton_bwd
from gem_kernels import attention_triton_stored as stored
from gem_kernels.attention_triton import query_major
from gem_kernels.attention_triton_bwd import key_major
from gem_kernels.reference import attention_mask
from gem_kernels.testing import offsets_from_lengths, random_qkv

pytestmark = pytest.mark.usefixtures("poison")


def packed_offsets(lengths: list[int], heads: int) -> list[list[dict[tuple[int, int], int]]]:
    """Each allowed-or-not (key j, query i >= floor8(j)) position of every (sequence, head), written
    out key row by key row: row j holds queries floor8(j) .. ceil8(n) - 1."""
    where, at = [], 0
    for n in lengths:
        per_head = []
        for _ in range(heads):
            cells = {}
            for j in range(n):
                for i in range(j // 8 * 8, -(-n // 8) * 8):
                    cells[(j, i)] = at
                    at += 1
            per_head.append(cells)
        where.append(per_head)
    return where


def packed_total(lengths: list[int], heads: int) -> int:
    return heads * sum(n * (-(-n // 8) * 8) - sum(j // 8 * 8 for j in range(n)) for n in lengths)


def expected_ds(q, k, v, g, lengths, targets, window, alpha):  # type: ignore[no-untyped-def]
    """float64 ``mask * <g_i, v_j> * silu'(alpha <q_i, k_j>)`` per sequence, ``[H, n, n]`` each."""
    offsets = offsets_from_lengths(lengths)
    size = max(lengths)
    mask = attention_mask(torch.tensor(lengths), targets, window, size)
    result = []
    for b, n in enumerate(lengths):
        a, e = int(offsets[b]), int(offsets[b + 1])
        s = alpha * torch.einsum("ihd,jhd->hij", q[a:e].double(), k[a:e].double())
        sig = torch.sigmoid(s)
        dp = torch.einsum("ihd,jhd->hij", g[a:e].double(), v[a:e].double())
        result.append(dp * sig * (1 + s * (1 - sig)) * mask[b, :n, :n])
    return result


def test_packed_layout_holds_every_allowed_ds(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dk/dv pass writes each allowed pair's ds at row start + j (offsets written out here, not by
    the module's formula), across chunk borders of the in-kernel scan and empty sequences."""
    monkeypatch.setattr(attention_triton_bwd, "CHUNK", 4)
    lengths = torch.randint(0, 30, (9,), generator=gen).tolist()
    lengths[2] = 0
    lengths[5] = 29
    heads, dim = 2, 16
    targets = torch.minimum(torch.randint(1, 4, (len(lengths),), generator=gen), torch.tensor(lengths))
    window, alpha, max_len = 7, 1.0 / math.sqrt(dim), 32
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(int(offsets[-1]), heads, dim, dim, torch.float32, gen)
    g = torch.randn(q.shape, generator=gen)
    ds = stored.allocate(q, max_len)
    key_major(q, k, v, g, offsets, targets, None, max_seq_len=max_len, alpha=alpha, max_attn_len=window, ds=ds)
    want = expected_ds(q, k, v, g, lengths, targets, window, alpha)
    mask = attention_mask(torch.tensor(lengths), targets, window, max(lengths))
    cells = packed_offsets(lengths, heads)
    assert sum(len(c) for per_head in cells for c in per_head) == packed_total(lengths, heads)
    checked = 0
    for b, n in enumerate(lengths):
        for h in range(heads):
            for i in range(n):
                cols = torch.nonzero(mask[b, i, :n]).flatten().tolist()
                assert max(cols) <= i  # the mask never reaches right of the diagonal
                got = ds[[cells[b][h][(j, i)] for j in cols]]
                torch.testing.assert_close(got.double(), want[b][h, i, cols], rtol=1e-5, atol=1e-6)
                checked += len(cols)
    assert checked == int(mask.sum()) * heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dq_with_partial_capacity(gen: torch.Generator, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences past the buffer's capacity recompute their scores: dq is the separate pass's dq for
    any capacity (all, some, none), and nothing is written past the capacity."""
    monkeypatch.setattr(attention_triton, "CHUNK", 4)
    monkeypatch.setattr(attention_triton_bwd, "CHUNK", 4)
    lengths = torch.randint(1, 24, (7,), generator=gen).tolist()
    heads, dim, max_len = 2, 16, 24
    targets = torch.minimum(torch.randint(1, 4, (len(lengths),), generator=gen), torch.tensor(lengths))
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(int(offsets[-1]), heads, dim, dim, dtype, gen)
    g = torch.randn(q.shape, generator=gen).to(dtype)
    options = dict(max_seq_len=max_len, alpha=0.25, max_attn_len=0)
    dk0, dv0 = key_major(q, k, v, g, offsets, targets, None, **options)
    dq0 = query_major(q, k, v, g, offsets, targets, **options)
    needed = packed_total(lengths, heads)
    assert needed <= stored.capacity(q.shape[0], heads, max_len, q.element_size())
    sentinel = 12345.0
    for size in (needed, needed // 2, 0):
        buffer = torch.full((size + stored.SLACK + 1,), sentinel, dtype=dtype)
        ds = buffer[: max(size, 1)]
        dk, dv = key_major(q, k, v, g, offsets, targets, None, ds=ds, **options)
        dq = query_major(q, k, v, g, offsets, targets, ds=ds, **options)
        assert torch.equal(dk, dk0) and torch.equal(dv, dv0)  # storing changes nothing else
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(dq.float(), dq0.float(), rtol=tolerance, atol=tolerance * dq0.abs().max().item())
        assert torch.all(buffer[max(size, 1):] == sentinel), f"written past a capacity of {size}"


def test_capacity_bounds_the_packed_size() -> None:
    for lengths, max_len in (([1, 2, 3], 3), ([4096] * 3, 4096), ([0, 17, 9, 64, 65], 65), ([1] * 100, 1), ([9], 9)):
        assert packed_total(lengths, 1) <= stored.capacity(sum(lengths), 1, max_len, 2), (lengths, max_len)
    assert stored.capacity(200_000, 8, 4096, 2, budget_bytes=2**30) == 2**29  # the budget caps it


def test_bad_buffers_are_refused() -> None:
    q = torch.zeros(4, 1, 16)
    offsets = torch.tensor([0, 4])
    options = dict(max_seq_len=4, alpha=1.0, max_attn_len=0)
    with pytest.raises(ValueError, match="is for dq; the forward was asked for"):
        query_major(q, q, q, None, offsets, None, ds=stored.allocate(q, 4), **options)
    with pytest.raises(ValueError, match="ds must be a contiguous 1-d torch.float32 buffer"):
        key_major(q, q, q, q, offsets, None, None, ds=torch.zeros(8, dtype=torch.bfloat16), **options)
    with pytest.raises(ValueError, match="256 elements of storage past its end"):
        key_major(q, q, q, q, offsets, None, None, ds=torch.zeros(8), **options)  # no slack
    with pytest.raises(ValueError, match="exclude each other"):
        key_major(q, q, q, q, offsets, None, torch.zeros(4, 1, 16), ds=stored.allocate(q, 4), **options)
