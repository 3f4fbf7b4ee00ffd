"""The backward's slot for a gradient's quantized rows (gem_model.grad_rows): an offer is taken only by the
very gradient it was made from, unchanged, once; through a real autograd graph a consumer gets it when
its output has one use and not when autograd summed two; bad offers and bad linears are named."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from gem_model.api import (
    GradRows,
    GradRowsSlot,
    PrequantizedRows,
    attach_grad_rows,
    attached_grad_rows,
    call_linear,
    grad_rows_slot,
)


def rows_for(g: torch.Tensor) -> PrequantizedRows:
    """Rows standing for ``g`` (any bytes do for the slot: it checks shapes, not values)."""
    return PrequantizedRows(torch.zeros(g.shape, dtype=torch.float8_e4m3fn), torch.ones(g.shape[0]))


def test_an_offer_is_taken_once_by_the_tensor_it_was_made_from():
    g = torch.randn(6, 8)
    slot = GradRowsSlot()
    assert slot.take(g) is None  # nothing offered
    rows = rows_for(g)
    slot.offer(g, rows)
    taken = slot.take(g)
    assert isinstance(taken, GradRows) and taken.rows is rows and taken.column_sum is None
    assert slot.take(g) is None  # once


@pytest.mark.parametrize("other", ["equal_values", "in_place_change", "view", "transposed_copy"])
def test_another_or_a_changed_gradient_takes_nothing(other):
    g = torch.randn(6, 8)
    slot = GradRowsSlot()
    slot.offer(g, rows_for(g))
    if other == "equal_values":
        got = g.clone()
    elif other == "in_place_change":
        g.add_(1)  # a hook or an accumulation in place: the version counter moved
        got = g
    elif other == "view":
        got = g[1:]
    else:
        got = g.t().contiguous().t()
    assert slot.take(got) is None


def test_column_sums_are_carried_when_asked_and_offered():
    g = torch.randn(6, 8)
    slot = GradRowsSlot(column_sum=True)
    with pytest.raises(ValueError, match=r"column sums must be float32 \[8\], got torch.float64 \(8,\)"):
        slot.offer(g, rows_for(g), g.double().sum(0))
    with pytest.raises(ValueError, match=r"column sums must be float32 \[8\], got torch.float32 \(7,\)"):
        slot.offer(g, rows_for(g), g[:, :7].sum(0))
    sums = g.sum(0)
    slot.offer(g, rows_for(g), sums)
    assert slot.take(g).column_sum is sums
    slot.offer(g, rows_for(g))  # a producer may leave the sums to the linear
    assert slot.take(g).column_sum is None
    unasked = GradRowsSlot()
    unasked.offer(g, rows_for(g), sums)
    assert unasked.take(g).column_sum is None  # not asked for: not handed on


def test_a_slot_for_column_sums_alone_takes_offers_without_rows():
    g = torch.randn(6, 8)
    slot = GradRowsSlot(column_sum=True, rows=False)
    with pytest.raises(ValueError, match="this slot asks for no rows, and the offer has some"):
        slot.offer(g, rows_for(g), g.sum(0))
    sums = g.sum(0)
    slot.offer(g, None, sums)
    taken = slot.take(g)
    assert taken.rows is None and taken.column_sum is sums
    with pytest.raises(ValueError, match="this slot asks for rows, and the offer has none"):
        GradRowsSlot(column_sum=True).offer(g, None, sums)
    with pytest.raises(ValueError, match="asks for the gradient's rows, its column sums or both"):
        GradRowsSlot(rows=False)


def test_an_offer_must_match_its_gradient():
    g = torch.randn(6, 8)
    slot = GradRowsSlot()
    with pytest.raises(ValueError, match=r"do not match the input \(6, 8\)"):
        slot.offer(g, rows_for(torch.randn(5, 8)))
    with pytest.raises(ValueError, match="contiguous rows"):
        slot.offer(g.t(), rows_for(g.t().contiguous()))
    with pytest.raises(ValueError, match=r"\[M, N\]"):
        slot.offer(g.reshape(2, 3, 8), rows_for(g))


class Producer(torch.autograd.Function):
    """Identity forward; backward writes the gradient anew (as a kernel would) and offers its rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slot: GradRowsSlot) -> torch.Tensor:  # type: ignore[override]
        ctx.slot = slot
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        written = g * 2
        ctx.slot.offer(written, rows_for(written))
        return written, None


class Consumer(torch.autograd.Function):
    """A "linear" whose backward records what the slot handed it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, slot: GradRowsSlot, seen: list) -> torch.Tensor:  # type: ignore[override]
        ctx.slot, ctx.seen = slot, seen
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        ctx.seen.append(ctx.slot.take(g))
        return g, None, None


def test_through_autograd_the_consumer_takes_the_rows_of_its_only_use():
    x = torch.randn(4, 8, requires_grad=True)
    slot, seen = GradRowsSlot(), []
    Producer.apply(Consumer.apply(x, slot, seen), slot).sum().backward()
    assert len(seen) == 1 and seen[0] is not None


def test_through_autograd_a_second_use_of_the_output_means_no_rows():
    x = torch.randn(4, 8, requires_grad=True)
    slot, seen = GradRowsSlot(), []
    out = Consumer.apply(x, slot, seen)
    (Producer.apply(out, slot).sum() + out.sum()).backward()  # autograd sums the two gradients of out
    assert seen == [None]


class SlotLinear(torch.nn.Linear):
    def __init__(self, answer: Any):
        super().__init__(8, 8)
        self.answer, self.calls = answer, []

    def grad_rows_slot(self, device: torch.device) -> Any:
        return self.answer

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.calls.append(sorted(kwargs))
        return super().forward(x)


def test_grad_rows_slot_asks_the_linear_and_call_linear_hands_the_slot_over():
    slot = GradRowsSlot()
    linear = SlotLinear(slot)
    assert grad_rows_slot(linear, torch.device("cpu")) is slot
    with torch.no_grad():
        assert grad_rows_slot(linear, torch.device("cpu")) is None  # no backward, no slot
    assert grad_rows_slot(torch.nn.Linear(8, 8), torch.device("cpu")) is None
    assert grad_rows_slot(lambda t: t, torch.device("cpu")) is None
    x = torch.randn(2, 8)
    call_linear(linear, x, None, slot)
    call_linear(linear, x, None)
    assert linear.calls == [["grad_rows"], []]
    with pytest.raises(TypeError, match="SlotLinear.grad_rows_slot returned str; expected GradRowsSlot or None"):
        grad_rows_slot(SlotLinear("slot"), torch.device("cpu"))


def test_a_tensor_tagged_with_a_slot_carries_it_and_ops_on_it_do_not():
    slot = GradRowsSlot()
    t = torch.randn(3, 4)
    assert attached_grad_rows(t) is None
    attach_grad_rows(t, slot)
    assert attached_grad_rows(t) is slot
    assert attached_grad_rows(t + 0) is None and attached_grad_rows(t.view(3, 4)) is None
    with pytest.raises(TypeError, match="expected a GradRowsSlot, got dict"):
        attach_grad_rows(t, {})
