"""A linear whose output gradient arrives pre-quantized: the backward's side of :mod:`gem_model.prequantized`.

An fp8 linear's backward quantizes the gradient of its output, ``g [M, N]``, for ``dx = g @ W``: one
pass reads ``g`` for each row's maximum and writes the e4m3 rows (and, for the bias, sums its columns).
When the kernel that wrote ``g`` held each row whole (the fused HSTU gap's last backward pass writes
the whole gradient of the ``uvqk`` projection's output), it can write those rows, their scales and the
column sums in the same pass, and the linear's backward skips its own.

Autograd hands one plain tensor from a function's backward to the next, so the rows travel beside it,
through a :class:`GradRowsSlot` set up in the forward by the code that calls both:

- the linear makes the slot, ``linear.grad_rows_slot(device) -> GradRowsSlot | None`` (None: it
  quantizes its gradient itself, or not in this rule), and is called with it,
  ``linear(x, grad_rows=slot)`` (:func:`gem_model.prequantized.call_linear`);
- the producer's backward, having written ``g``, calls ``slot.offer(g, rows, column_sum)``;
- the linear's backward calls ``slot.take(grad_out)``, which returns the rows only when ``grad_out`` is
  the very tensor offered, unchanged since (same storage, shape, strides, dtype and version counter).
  Autograd sums the gradients of every use of a tensor: when the linear's output had another use, or
  a hook replaced or changed the gradient, ``take`` returns None and the linear quantizes what it got.

:func:`grad_rows_slot` is the producer side's whole use of it: a callable without the method gets no
slot. When the producer is the next op rather than a kernel of the caller's own (the next HSTU block's
layer norm writes the gradient of this block's output, which the residual add hands on unchanged to
the output projection), the caller tags the tensor whose gradient that is with the slot
(:func:`attach_grad_rows`) and the next op looks it up (:func:`attached_grad_rows`); the tag dies with
the tensor, and any op in between makes a new tensor without it. The rows follow :class:`~gem_model.prequantized.RowQuantization`'s rule (e4m3, a power-of-two
scale per row), of the gradient as stored; the column sums, when offered, are float32 sums of its
columns as stored.

A linear that needs no rows (its backward's GEMMs read the gradient as it is: the ``bf16`` scheme's)
may still want the column sums for its bias: its slot says ``rows=False``, and a producer that can sum
the gradient while writing it offers the sums alone (the next HSTU block's layer norm backward, which
writes the gradient of this block's ``out`` linear, sums it there instead of in a pass of the linear's own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from gem_model.prequantized import PrequantizedRows


@dataclass(frozen=True)
class GradRows:
    """What a producer offers for a gradient ``g [M, N]``: its e4m3 rows (None for a slot that asked for
    none) and, when the slot asked for them and the producer summed them, the float32 column sums ``[N]``
    (the linear's bias gradient; None: the linear sums ``g`` itself)."""

    rows: PrequantizedRows | None
    column_sum: torch.Tensor | None = None


class GradRowsSlot:
    """One backward's hand-over of a gradient's quantized rows from the kernel that wrote the gradient
    to the linear whose output it is the gradient of (see the module docstring).

    ``column_sum``: the linear needs the gradient's column sums too (its bias takes a gradient). An offer
    may carry them (one pass of the linear saved) or not (the linear sums the gradient itself).
    ``rows``: the linear takes the gradient's e4m3 rows (False: only the column sums are asked for, and
    an offer carries no rows; ``column_sum`` must then be True). The slot keeps the offered gradient
    alive until it is taken, so that no other tensor can take its place in memory meanwhile.
    """

    def __init__(self, *, column_sum: bool = False, rows: bool = True):
        if not rows and not column_sum:
            raise ValueError("GradRowsSlot: a slot asks for the gradient's rows, its column sums or both")
        self.column_sum = column_sum
        self.rows = rows
        self._offer: tuple[torch.Tensor, int, GradRows] | None = None

    def offer(self, grad: torch.Tensor, rows: PrequantizedRows | None, column_sum: torch.Tensor | None = None) -> None:
        """``rows`` (and ``column_sum``) quantized from ``grad [M, N]`` as it is now; checked against it.
        ``rows`` is None exactly when the slot asked for none (``rows=False``)."""
        if grad.dim() != 2 or grad.stride(-1) != 1:
            raise ValueError(f"GradRowsSlot.offer: the gradient must be [M, N] with contiguous rows, got "
                             f"{tuple(grad.shape)} strides {grad.stride()}")  # fmt: skip
        if (rows is None) == self.rows:
            raise ValueError(f"GradRowsSlot.offer: this slot asks for {'rows' if self.rows else 'no rows'}, "
                             f"and the offer has {'none' if rows is None else 'some'}")  # fmt: skip
        if rows is not None:
            rows.check_input(grad, "GradRowsSlot.offer")
        n = grad.shape[1]
        if column_sum is not None and (column_sum.dtype != torch.float32 or column_sum.shape != (n,)):
            raise ValueError(f"GradRowsSlot.offer: column sums must be float32 [{n}], got {column_sum.dtype} "
                             f"{tuple(column_sum.shape)}")  # fmt: skip
        self._offer = (grad, grad._version, GradRows(rows, column_sum if self.column_sum else None))

    def take(self, grad: torch.Tensor) -> GradRows | None:
        """The offer, when ``grad`` is the tensor offered and unchanged since; else None. Empties the slot."""
        offer, self._offer = self._offer, None
        if offer is None:
            return None
        offered, version, rows = offer
        same = (
            grad.device == offered.device and grad.dtype == offered.dtype and grad.shape == offered.shape
            and grad.stride() == offered.stride() and grad.data_ptr() == offered.data_ptr()
            and grad._version == version
        )  # fmt: skip
        return rows if same else None

    def __repr__(self) -> str:
        return f"GradRowsSlot(column_sum={self.column_sum}, rows={self.rows}, offered={self._offer is not None})"


def grad_rows_slot(linear: Callable[..., Any], device: torch.device) -> GradRowsSlot | None:
    """The slot ``linear`` takes its output gradient's rows through on ``device``, or None (a callable
    without ``grad_rows_slot``, or a linear that quantizes its gradient itself there)."""
    ask = getattr(linear, "grad_rows_slot", None)
    if ask is None or not torch.is_grad_enabled():
        return None
    slot = ask(device)
    if slot is not None and not isinstance(slot, GradRowsSlot):
        raise TypeError(
            f"{type(linear).__name__}.grad_rows_slot returned {type(slot).__name__}; expected GradRowsSlot or None"
        )
    return slot


_ATTACHED = "_gem_grad_rows_slot"


def attach_grad_rows(t: torch.Tensor, slot: GradRowsSlot) -> None:
    """Tag ``t``: whatever writes ``t``'s gradient may offer its rows to ``slot``, whose linear's output
    gets that gradient unchanged (``t = skip + linear(y)``: the add hands its gradient on as is)."""
    if not isinstance(slot, GradRowsSlot):
        raise TypeError(f"attach_grad_rows: expected a GradRowsSlot, got {type(slot).__name__}")
    setattr(t, _ATTACHED, slot)


def attached_grad_rows(t: torch.Tensor) -> GradRowsSlot | None:
    """The slot :func:`attach_grad_rows` tagged ``t`` with, or None."""
    slot = getattr(t, _ATTACHED, None)
    return slot if isinstance(slot, GradRowsSlot) else None
