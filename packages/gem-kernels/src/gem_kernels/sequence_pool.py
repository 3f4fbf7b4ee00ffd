"""The ``sequence_pool`` kernel ``triton``: the sequence tower's final layer norm, its history rows, last
rows and history means in one Triton pass over the rows (and one backward), where the core's ``torch``
kernel runs a layer norm, a row gather and a segment mean (a membership GEMM) with their backwards.

The math is :class:`gem_model.api.SequencePoolKernel`'s; the kernels are in
:mod:`gem_kernels.sequence_pool_triton`. Calls under ``torch.compile`` run the core's torch kernel.
Importing this module never imports triton.
"""

from __future__ import annotations

import torch

from gem_kernels.availability import require_triton
from gem_model.api import (
    KernelUnavailableError,
    SequencePoolKernel,
    check_sequence_pool_inputs,
    sequence_pool_torch,
)


class TritonSequencePool(SequencePoolKernel):
    """Forward: each program normalizes a chunk of one sequence's rows, writes them where they go
    (history, last row) and sums its history rows for the mean; a small pass adds the chunks' sums.
    Backward: one pass writes the rows' gradient (history, last-row and mean gradients together) and
    the weight and bias partial sums. No atomics: the same inputs give the same bits."""

    name = "triton"

    def check_available(self, device: torch.device) -> None:
        require_triton(device, op=self.op, name=self.name)

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
        check_sequence_pool_inputs(x, offsets, hist_lengths, lead=lead)
        if torch.compiler.is_compiling():
            return sequence_pool_torch(x, weight, bias, eps, offsets, hist_lengths, lead=lead, candidate=candidate)
        require_triton(x.device, op=self.op, name=self.name, in_call=True)
        from gem_kernels.row_blocks import MAX_DIM
        from gem_kernels.sequence_pool_triton import sequence_pool_triton

        if x.shape[1] > MAX_DIM:
            raise KernelUnavailableError(
                f"kernels.{self.op}: 'triton' holds a row in registers and takes D <= {MAX_DIM}, got {x.shape[1]}"
            )
        return sequence_pool_triton(x, weight, bias, eps, offsets, lead=lead, candidate=candidate, max_len=max_len)
