"""The ``sequence_input`` kernel ``triton``: the sequence tower's rows assembled from its history's item
and action embeddings, the context token, the candidate and the position rows in one Triton pass, and
the gradients back in one more, where the core's ``torch`` kernel runs an add, the candidate's and
context token's row moves, a gather of the position rows and another add, and in backward a gather and
a sort-based embedding backward for the position table.

The math is :class:`gem_model.api.SequenceInputKernel`'s; the kernels are in
:mod:`gem_kernels.sequence_input_triton`. Calls under ``torch.compile`` run the core's torch kernel.
Importing this module never imports triton.
"""

from __future__ import annotations

import torch

from gem_kernels.availability import require_triton
from gem_model.api import (
    KernelUnavailableError,
    SequenceInputKernel,
    check_sequence_input_inputs,
    offsets_of,
    sequence_input_torch,
)


class TritonSequenceInput(SequenceInputKernel):
    """Forward: each program assembles a chunk of one sequence's rows (history, context token,
    candidate, plus the position rows). Backward: each program takes a block of positions and columns,
    walks the sequences long enough to reach them (longest first), writes their rows' gradients and sums
    the position table's gradient in registers. No atomics: the same inputs give the same bits."""

    name = "triton"

    def check_available(self, device: torch.device) -> None:
        require_triton(device, op=self.op, name=self.name)

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
        check_sequence_input_inputs(item, action, hist_lengths, first, last, position)
        if torch.compiler.is_compiling():
            return sequence_input_torch(item, action, hist_lengths, scale=scale, first=first, last=last,
                                        position=position, dtype=dtype)  # fmt: skip
        require_triton(item.device, op=self.op, name=self.name, in_call=True)
        from gem_kernels.row_blocks import MAX_DIM
        from gem_kernels.sequence_input_triton import sequence_input_triton

        if item.shape[1] > MAX_DIM:
            raise KernelUnavailableError(
                f"kernels.{self.op}: 'triton' holds a row in registers and takes D <= {MAX_DIM}, got {item.shape[1]}"
            )
        hist_lengths = hist_lengths.long()  # a KJT's lengths may be int32
        return sequence_input_triton(item, action, hist_lengths, offsets_of(hist_lengths), scale=scale, first=first,
                                     last=last, position=position, dtype=dtype, max_len=max_len)  # fmt: skip
