"""The ``sequence_pool`` kernel ``torch``: the sequence tower's final layer norm, then each sequence's
history rows, last row and history mean, as torch ops (the math: :class:`gem_model.kernels.SequencePoolKernel`).

The layer norm runs in ``x``'s dtype with the weight and bias cast to it (torch's norm kernels keep the
statistics in float32), as :class:`gem_model.model.hstu.LayerNorm` does. The rows are taken by
:func:`gem_model.jagged.split_rows` when every sequence is its history plus a candidate (one gather, and
a backward that writes each gradient row once), else by indexing; the mean is
:func:`gem_model.jagged.segment_mean`. gem-model registers it (:mod:`gem_model.builtin`) and it is the
default of ``kernels.sequence_pool``; gem-kernels' ``triton`` does the same in one pass over the rows.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from gem_model.jagged import offsets_of, segment_mean, split_rows
from gem_model.kernels import SequencePoolKernel


def check_sequence_pool_inputs(x: torch.Tensor, offsets: torch.Tensor, hist_lengths: torch.Tensor, *, lead: int) -> None:
    """The shapes a ``sequence_pool`` kernel needs (no values are read: that would sync the device)."""
    if x.dim() != 2:
        raise ValueError(f"sequence_pool: x must be [N, D] rows, got shape {tuple(x.shape)}")
    if lead not in (0, 1):
        raise ValueError(f"sequence_pool: lead must be 0 or 1 (rows before the history), got {lead}")
    if offsets.dim() != 1 or offsets.numel() != hist_lengths.numel() + 1:
        raise ValueError(f"sequence_pool: offsets must be [B + 1] for the {hist_lengths.numel()} history lengths, "
                         f"got shape {tuple(offsets.shape)}")  # fmt: skip


def sequence_pool_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    offsets: torch.Tensor,
    hist_lengths: torch.Tensor,
    *,
    lead: int,
    candidate: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(hist, last, mean)`` of :class:`~gem_model.kernels.SequencePoolKernel`, as torch ops."""
    check_sequence_pool_inputs(x, offsets, hist_lengths, lead=lead)
    y = F.layer_norm(x, (x.shape[1],), weight.to(x.dtype), bias.to(x.dtype), eps)
    b = hist_lengths.numel()
    last = offsets[1:] - 1
    hist_rows = None
    if candidate or lead:
        # rows lead .. lead + history length of each sequence; every sequence has exactly one candidate
        # (when ``candidate``) and one lead row, so their count is known without a sync
        count = y.shape[0] - b * (lead + int(candidate))
        shift = offsets[:-1] + lead - offsets_of(hist_lengths)[:-1]
        hist_rows = torch.arange(count, device=y.device) + torch.repeat_interleave(shift, hist_lengths, output_size=count)
    if hist_rows is not None and candidate and not lead:
        # the history rows and the candidates' (each sequence's last) are all the rows: one split
        hist, summary = split_rows(y, hist_rows, last)
    else:
        lengths = offsets[1:] - offsets[:-1]
        if y.shape[0]:
            summary = torch.where((lengths > 0)[:, None], y[last.clamp(min=0)], y.new_zeros(()))
        else:  # every sequence empty
            summary = y.new_zeros(b, y.shape[1])
        hist = y if hist_rows is None else y[hist_rows]
    # summed in float32: a bf16 sum over thousands of rows would round away most of them
    return hist, summary, segment_mean(hist, hist_lengths)


class TorchSequencePool(SequencePoolKernel):
    """The ``sequence_pool`` kernel ``torch``: :func:`sequence_pool_torch`, on any device and dtype."""

    name: ClassVar[str] = "torch"

    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
        offsets: torch.Tensor,
        hist_lengths: torch.Tensor,
        *,
        lead: int,
        candidate: bool,
        max_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return sequence_pool_torch(x, weight, bias, eps, offsets, hist_lengths, lead=lead, candidate=candidate)
