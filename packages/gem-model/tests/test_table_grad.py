"""``gem_model.table_grad``: a lookup's per-feature views whose gradients meet in one buffer, against the
gradient autograd gives plain slices of the same tensor; and ``SparseArch`` recognising torchrec's split.

Fresh random data per test; fresh memory is NaN (``poisoned``), the buffer's too, so a row that no
consumer and not the node writes shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gem_model.model import embeddings
from gem_model.table_grad import GradSection, grad_section, table_views

SIZES = [5, 0, 3, 4]


@pytest.fixture
def poisoned() -> Iterator[None]:
    was, filling = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = filling
    torch.use_deterministic_algorithms(was)


class Claiming(torch.autograd.Function):
    """``x * w`` whose backward writes (or adds) ``x``'s gradient into its section and returns None."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, section: GradSection) -> torch.Tensor:  # type: ignore[override]
        ctx.w, ctx.section = w, section
        return x * w

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        rows, accumulate = ctx.section.claim()
        if accumulate:
            rows.add_(g * ctx.w)
        else:
            rows.copy_(g * ctx.w)
        return None, None, None


def _uses(views: tuple[torch.Tensor, ...], w: list[torch.Tensor], claim: bool) -> torch.Tensor:
    """View 0 read by two consumers (one claiming where ``claim``), view 2 by a plain op, views 1 and 3
    (empty, and unused) by none."""
    a, _, c, _ = views
    first = Claiming.apply(a, w[0], grad_section(a)) if claim else a * w[0]
    return (first.sum() * 2 + (a * w[1]).square().sum()) + (c * w[2]).sum()


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("claim", [True, False], ids=["claiming", "plain"])
@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_the_buffer_holds_the_gradient_of_the_slices(claim: bool, scale: float) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    data = torch.randn(sum(SIZES), 6, generator=gen)
    w = [torch.randn(SIZES[0], 6, generator=gen), torch.randn(SIZES[0], 6, generator=gen), torch.randn(SIZES[2], 6, generator=gen)]
    gates: list[float] = []
    base = data.clone().requires_grad_()
    views = table_views(base, SIZES, gate=lambda: gates.append(1.0), scale=scale)
    assert [v.shape[0] for v in views] == SIZES
    assert all(torch.equal(v, s) for v, s in zip(views, data.split(SIZES), strict=True))
    assert [(s.start, s.stop) for s in map(grad_section, views)] == [(0, 5), (5, 5), (5, 8), (8, 12)]  # type: ignore[union-attr]
    _uses(views, w, claim).backward()
    plain = data.clone().requires_grad_()
    (_uses(plain.split(SIZES), w, claim=False) * scale).backward()
    assert gates == [1.0]
    assert not base.grad.isnan().any()
    torch.testing.assert_close(base.grad, plain.grad, rtol=1e-6, atol=1e-7)
    assert torch.equal(base.grad[8:], torch.zeros(4, 6))  # no gradient reached the last view: zeros


def test_a_second_backward_through_the_same_graph_starts_a_fresh_buffer() -> None:
    base = torch.randn(12, 3, requires_grad=True)
    w = [torch.randn(5, 3), torch.randn(5, 3), torch.randn(3, 3)]
    loss = _uses(table_views(base, SIZES), w, claim=True)
    first = torch.autograd.grad(loss, base, retain_graph=True)[0]
    again = torch.autograd.grad(loss, base)[0]
    assert torch.equal(first, again)


def test_a_gate_that_raises_stops_the_gradient_before_the_table() -> None:
    base = torch.randn(12, 3, requires_grad=True)

    def gate() -> None:
        raise RuntimeError("the loss is not finite")

    views = table_views(base, SIZES, gate=gate)
    with pytest.raises(RuntimeError, match="not finite"):
        _uses(views, [torch.ones(5, 3), torch.ones(5, 3), torch.ones(3, 3)], claim=True).backward()
    assert base.grad is None


def test_without_autograd_the_views_are_plain_slices() -> None:
    base = torch.randn(12, 3, requires_grad=True)
    with torch.no_grad():
        views = table_views(base, SIZES)
    assert all(grad_section(v) is None for v in views)
    assert [v.data_ptr() for v in views] == [s.data_ptr() for s in base.split(SIZES)]
    assert grad_section(base) is None and grad_section(None) is None


@pytest.mark.parametrize(("shape", "sizes", "message"), [
    ((12,), [12], r"base must be \[rows, D\], got shape \(12,\)"),
    ((12, 3), [5, 6], r"sizes \[5, 6\] must be non-negative and sum to base's 12 rows"),
    ((12, 3), [13, -1], r"sizes \[13, -1\] must be non-negative"),
])  # fmt: skip
def test_bad_sizes_are_named(shape: tuple[int, ...], sizes: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        table_views(torch.zeros(shape, requires_grad=True), sizes)


def test_tiling_recognises_torchrec_s_split_and_nothing_else() -> None:
    base = torch.randn(12, 4, requires_grad=True) * 1.0  # a lookup's output: not a leaf
    a, b, c, d = base.split(SIZES)
    got = embeddings.tiling([c, a, d, b])
    assert got is not None and got[0] is base and got[1] == [1, 3, 0, 2]
    assert embeddings.tiling([a, c, d]) is not None  # without the empty view: still every row once
    assert embeddings.tiling([a, d]) is None  # rows 5:8 missing
    assert embeddings.tiling([a, base[4:8], d]) is None  # overlapping
    assert embeddings.tiling([base[:, :2], base[:, 2:]]) is None  # columns, not rows
    assert embeddings.tiling([a.clone(), b, c, d]) is None  # not a view
    other = torch.randn(12, 4, requires_grad=True) * 1.0
    assert embeddings.tiling([a, b, c, other[8:]]) is None  # another tensor's rows
    assert embeddings.tiling(list(base.detach().split(SIZES))) is None  # no gradient to gather
    assert embeddings.tiling([]) is None


@pytest.mark.parametrize("one_buffer", [True, False])
def test_sparse_arch_hands_the_model_views_of_one_buffer(monkeypatch: pytest.MonkeyPatch, one_buffer: bool) -> None:
    monkeypatch.setattr(embeddings, "ONE_GRADIENT_BUFFER", one_buffer)
    arch = object.__new__(embeddings.SparseArch)  # only the rows' hand-over: no tables needed
    torch.nn.Module.__init__(arch)
    gates: list[int] = []
    arch.grad_scale, arch.grad_gate = 0.25, lambda: gates.append(1)
    data = torch.randn(12, 4)
    base = data.clone().requires_grad_()
    out = base * 1.0
    keys = ["seq_item", "neg_item", "cand_item", "seq_action"]
    values = arch._sequence_values(dict(zip(keys, out.split(SIZES), strict=True)))
    assert list(values) == keys
    assert all((grad_section(v) is not None) is one_buffer for v in values.values())
    w = torch.randn(12, 4)
    sum((v * w[s]).sum() for v, s in zip(values.values(), [slice(0, 5), slice(5, 5), slice(5, 8), slice(8, 12)], strict=True)).backward()
    assert len(gates) == (1 if one_buffer else 4)  # once for the buffer; once a feature before
    torch.testing.assert_close(base.grad, w * 0.25)
