"""One gradient buffer for a lookup's output, which the model reads as one view per feature.

torchrec hands a sequence lookup's output to the model as one ``[rows, D]`` tensor split into a view
per feature (``torch.split``). Autograd then gives each view a gradient of its own, and the split's
backward concatenates them into one tensor for the table's backward: a copy of every row's gradient.
Where a feature feeds two consumers (the history's items feed the sequence input and the next-item
loss's positives), autograd first adds their two gradients, another pass. On the H100's big config
the concatenation and that add took 0.74 and 0.51 ms of a ~209 ms profiled step (2026-12-07); with the
buffer the step is 1.003-1.006x (``benchmarks/results/e2e_ab.md``).

Here the views come from one autograd node over the whole output (:func:`table_views`), and a kernel
that consumes a view may write the view's gradient straight into its rows of the buffer that node
hands to the table's backward:

- in forward, :func:`grad_section` gives the kernel the view's :class:`GradSection` (None for any
  other tensor, or a view made without this);
- in backward, ``section.claim()`` returns those rows and whether a gradient is already there: the
  kernel writes its gradient into them, or adds it where one is, and returns None as the view's
  gradient.

A consumer that does not claim is exact too: the node copies, or adds, the gradient autograd hands
it for the view. Rows that no gradient reaches are zeroed. A section is claimed at most once a
backward by a writer and any number of times by adders, in whatever order autograd runs them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

import torch

_SECTION = "_gem_grad_section"


class GradSection:
    """Rows ``start : stop`` of a :class:`TableGrad`'s buffer: the gradient of one view."""

    def __init__(self, table: TableGrad, index: int):
        self.table, self.index = table, index

    @property
    def start(self) -> int:
        return self.table.bounds[self.index][0]

    @property
    def stop(self) -> int:
        return self.table.bounds[self.index][1]

    def claim(self) -> tuple[torch.Tensor, bool]:
        """This view's rows of the gradient buffer, and whether a gradient is already in them (the
        caller adds its own) or not (the caller writes every row). Call it in backward only, and
        write or add the whole gradient of the view: nothing else will."""
        return self.table.claim(self.index)

    def __repr__(self) -> str:
        return f"GradSection(rows {self.start}:{self.stop}, written={self.table.written[self.index]})"


class TableGrad:
    """The gradient of one lookup output ``base [rows, D]`` laid out as its views ``bounds`` (row ranges
    that tile it in order), for one backward at a time: the buffer exists from the first claim (or the
    node's backward) until the node hands it on."""

    def __init__(self, base: torch.Tensor, bounds: Sequence[tuple[int, int]]):
        self.shape, self.dtype, self.device = tuple(base.shape), base.dtype, base.device
        self.bounds = list(bounds)
        self.buffer: torch.Tensor | None = None
        self.written = [False] * len(self.bounds)

    def _rows(self, index: int) -> torch.Tensor:
        if self.buffer is None:
            self.buffer = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        start, stop = self.bounds[index]
        return self.buffer[start:stop]

    def claim(self, index: int) -> tuple[torch.Tensor, bool]:
        rows, accumulate = self._rows(index), self.written[index]
        self.written[index] = True
        return rows, accumulate

    def take(self, grads: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """The whole gradient: each view's rows as claimed, plus (or else) the gradient autograd gave the
        view, zeros where neither; the buffer is handed on and this object is ready for another backward."""
        for i, g in enumerate(grads):
            rows = self._rows(i)
            if g is not None and self.written[i]:
                rows.add_(g)
            elif g is not None:
                rows.copy_(g)
            elif not self.written[i]:
                rows.zero_()
        buffer = self.buffer if self.buffer is not None else torch.empty(self.shape, dtype=self.dtype, device=self.device)
        self.buffer, self.written = None, [False] * len(self.bounds)
        return buffer


class _TableViews(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, base: torch.Tensor, table: TableGrad, gate: Callable[[], None] | None,  # type: ignore[override]
                scale: float) -> tuple[torch.Tensor, ...]:  # fmt: skip
        ctx.table, ctx.gate, ctx.scale = table, gate, scale
        ctx.set_materialize_grads(False)
        return tuple(base[start:stop] for start, stop in table.bounds)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, None, None, None]:  # type: ignore[override]
        if ctx.gate is not None:
            ctx.gate()  # may raise: then no gradient reaches the table
        grad = ctx.table.take(grads)
        if ctx.scale != 1.0:
            grad.mul_(ctx.scale)
        return grad, None, None, None


def table_views(base: torch.Tensor, sizes: Sequence[int], gate: Callable[[], None] | None = None,
                scale: float = 1.0) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """``base``'s rows split into views of ``sizes`` rows (in order, covering it), whose gradients meet in
    one buffer: each view carries its :class:`GradSection` (:func:`grad_section`). In backward the node
    calls ``gate()`` first (before any gradient goes on to the table, whose update torchrec fuses into
    the lookup's backward), then multiplies the gradient by ``scale``. Without autograd (no gradient
    wanted) the views are plain slices."""
    if base.dim() != 2:
        raise ValueError(f"table_views: base must be [rows, D], got shape {tuple(base.shape)}")
    if any(n < 0 for n in sizes) or sum(sizes) != base.shape[0]:
        raise ValueError(f"table_views: sizes {list(sizes)} must be non-negative and sum to base's {base.shape[0]} rows")
    bounds = [(stop - n, stop) for n, stop in zip(sizes, accumulate(sizes), strict=True)]
    if not (base.requires_grad and torch.is_grad_enabled()):
        return tuple(base[a:b] for a, b in bounds)
    table = TableGrad(base, bounds)
    views = _TableViews.apply(base, table, gate, scale)
    for i, view in enumerate(views):
        setattr(view, _SECTION, GradSection(table, i))
    return tuple(views)


def grad_section(t: torch.Tensor | None) -> GradSection | None:
    """The :class:`GradSection` of a view :func:`table_views` made (the very tensor), or None."""
    section = getattr(t, _SECTION, None) if t is not None else None
    return section if isinstance(section, GradSection) else None
