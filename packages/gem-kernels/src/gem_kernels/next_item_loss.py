"""The ``next_item_loss`` kernel ``triton``: the sampled softmax with shared negatives in three Triton
kernels (forward; the query and item gradients; the negatives' gradient) instead of the core's
chunked GEMMs and per-row torch passes.

The math is the core's (:mod:`gem_model.model.next_item`); the kernels are in
:mod:`gem_kernels.next_item_loss_triton`. Per-position negatives, float32 queries, more
than :data:`MAX_NEGATIVES` negatives and calls under ``torch.compile`` run the core's torch loss,
which this kernel calls for them. Importing this module never imports triton.
"""

from __future__ import annotations

import torch

from gem_kernels.availability import require_triton
from gem_model.api import NextItemLossKernel, next_item_loss

FUSED_DTYPES = (torch.bfloat16, torch.float16)
"""Query dtypes the kernels take; the loss of float32 queries is the core's (its GEMMs keep fp32 bits)."""
MAX_NEGATIVES = 256
"""A tile's scores (32 rows x K, fp32) live in registers: more negatives run the core's loss."""


class TritonNextItemLoss(NextItemLossKernel):
    """Shared negatives in one forward kernel and two backward kernels: each tile of a sequence's rows
    scores its queries against the sequence's negatives and its positives in one pass over ``D``
    (norms and dot products included) and keeps the softmax in registers; nothing ``[rows, K]`` but
    the score gradients (``[L, K]`` in the query's dtype, for the negatives' gradient) is stored."""

    name = "triton"

    def check_available(self, device: torch.device) -> None:
        require_triton(device, op=self.op, name=self.name)

    def __call__(
        self,
        query: torch.Tensor,
        items: torch.Tensor,
        negatives: torch.Tensor,
        lengths: torch.Tensor,
        item_ids: torch.Tensor,
        negative_ids: torch.Tensor,
        *,
        num_negatives: int,
        per_position: bool,
        l2_normalize: bool,
        temperature: float,
        host_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if per_position or query.dtype not in FUSED_DTYPES or num_negatives > MAX_NEGATIVES or torch.compiler.is_compiling():
            return next_item_loss(
                query, items, negatives, lengths, item_ids, negative_ids, num_negatives=num_negatives,
                per_position=per_position, l2_normalize=l2_normalize, temperature=temperature,
                host_lengths=host_lengths,
            )
        require_triton(query.device, op=self.op, name=self.name, in_call=True)
        from gem_kernels.next_item_loss_triton import shared_negatives_loss

        return shared_negatives_loss(
            query, items, negatives, lengths, item_ids, negative_ids, num_negatives=num_negatives,
            l2_normalize=l2_normalize, temperature=temperature, host_lengths=host_lengths,
        )
