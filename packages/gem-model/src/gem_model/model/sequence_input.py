"""The ``sequence_input`` kernel ``torch``: the sequence tower's first step, each sequence's rows assembled
from its history's embeddings, as torch ops (the math: :class:`gem_model.kernels.SequenceInputKernel`).

The history rows are ``item * scale + action`` cast to the activation dtype; the context token goes in
front and the candidate at the end by :func:`gem_model.jagged.prepend_one` / :func:`append_one` (each
row written once), then the position rows are added (:func:`position_rows`). gem-model registers it
(:mod:`gem_model.builtin`) and it is the default of ``kernels.sequence_input``: the ops, and the bits,
the model ran before the op existed. gem-kernels' ``triton`` does it in one pass over the rows.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from gem_model.jagged import append_one, offsets_of, positions_in_sequence, prepend_one
from gem_model.kernels import SequenceInputKernel


def position_rows(table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``table[positions]`` in ``dtype`` (``table``: the position embedding's weight). On a GPU they are
    gathered from the table cast to ``dtype``: the values of casting the gathered rows, without writing
    them in the table's float32 first and casting them in a pass of their own (and, backward, casting
    their ``[L, D]`` gradient back before the table sums it). CUDA's embedding backward sums in float32
    and rounds each entry of the table's gradient once to ``dtype`` (as the bf16 linears' weight
    gradients are; on the H200 1.7e-3 relative to the float64 sum, 2026-12-04). The CPU's sums in the
    gradient's dtype, so there the rows are gathered in the table's dtype and cast."""
    if positions.is_cuda:
        return F.embedding(positions, table.to(dtype))
    return F.embedding(positions, table).to(dtype)


def check_sequence_input_inputs(
    item: torch.Tensor,
    action: torch.Tensor | None,
    hist_lengths: torch.Tensor,
    first: torch.Tensor | None,
    last: torch.Tensor | None,
    position: torch.Tensor | None,
) -> None:
    """The shapes a ``sequence_input`` kernel needs (no values are read: that would sync the device)."""
    if item.dim() != 2:
        raise ValueError(f"sequence_input: item must be [Nh, D] rows, got shape {tuple(item.shape)}")
    if action is not None and action.shape != item.shape:
        raise ValueError(f"sequence_input: action must have item's shape {tuple(item.shape)}, got {tuple(action.shape)}")
    if hist_lengths.dim() != 1:
        raise ValueError(f"sequence_input: hist_lengths must be [B], got shape {tuple(hist_lengths.shape)}")
    rows = (hist_lengths.numel(), item.shape[1])
    for name, t in (("first", first), ("last", last)):
        if t is not None and tuple(t.shape) != rows:
            raise ValueError(f"sequence_input: {name} must be [B, D] = {list(rows)}, got {tuple(t.shape)}")
    if position is not None and (position.dim() != 2 or position.shape[1] != item.shape[1]):
        raise ValueError(f"sequence_input: position must be the [P, {item.shape[1]}] table, got {tuple(position.shape)}")


def sequence_input_torch(
    item: torch.Tensor,
    action: torch.Tensor | None,
    hist_lengths: torch.Tensor,
    *,
    scale: float,
    first: torch.Tensor | None,
    last: torch.Tensor | None,
    position: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The rows of :class:`~gem_model.kernels.SequenceInputKernel`, as torch ops."""
    check_sequence_input_inputs(item, action, hist_lengths, first, last, position)
    x = item * scale if scale != 1.0 else item
    x = (x if action is None else x + action).to(dtype)  # the one cast of the sequence input into the activation dtype
    lengths = hist_lengths
    if first is not None:
        x, lengths = prepend_one(x, lengths, first)
    if last is not None:
        x, lengths = append_one(x, lengths, last.to(x.dtype))
    if position is not None:
        offsets = offsets_of(lengths)
        x = x + position_rows(position, positions_in_sequence(lengths, offsets, total=x.shape[0]), x.dtype)
    return x


class TorchSequenceInput(SequenceInputKernel):
    """The ``sequence_input`` kernel ``torch``: :func:`sequence_input_torch`, on any device and dtype."""

    name: ClassVar[str] = "torch"

    def __call__(
        self,
        item: torch.Tensor,
        action: torch.Tensor | None,
        hist_lengths: torch.Tensor,
        *,
        scale: float,
        first: torch.Tensor | None,
        last: torch.Tensor | None,
        position: torch.Tensor | None,
        dtype: torch.dtype,
        max_len: int,
    ) -> torch.Tensor:
        return sequence_input_torch(item, action, hist_lengths, scale=scale, first=first, last=last,
                                    position=position, dtype=dtype)  # fmt: skip
