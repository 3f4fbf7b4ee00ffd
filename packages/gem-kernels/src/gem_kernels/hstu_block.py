"""The HSTU block fused around its two linears: what gem-kernels' ``triton`` attention kernel offers as
:meth:`~gem_model.components.JaggedAttentionKernel.fused_block` (imports triton).

    ln, skip = norm_fork(x)                      # layer norm + the residual branch (layer_norm_triton)
    y = hstu_gap(uvqk(ln), gate_weight, ...)     # silu, split, attention, norm-gate (hstu_gap_triton)
    return skip + out(y)

The linears are the block's own modules (the precision scheme's GEMMs), called in between. What the
fusion removes, per block: the silu passes and the concatenation of the four gradients around the
attention, the ``silu(u)`` tensor, and the pass that adds the residual's gradient to the layer norm's.
``saved_format="e4m3_row"`` (from the block's activation policy) reaches the gap, which then keeps
its pre-activation in e4m3 rows (:mod:`gem_kernels.hstu_gap_saved`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from gem_kernels.hstu_gap_triton import hstu_gap_triton
from gem_kernels.layer_norm_triton import norm_fork


def hstu_block_triton(
    x: torch.Tensor,
    uvqk: Callable[[torch.Tensor], torch.Tensor],
    out: Callable[[torch.Tensor], torch.Tensor],
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    seq_offsets: torch.Tensor,
    **gap_options: Any,
) -> torch.Tensor:
    """``x + out(gap(uvqk(layer_norm(x))))``; ``gap_options`` as :func:`hstu_gap_triton` takes them."""
    ln, skip = norm_fork(x)
    y = hstu_gap_triton(uvqk(ln), gate_weight, gate_bias, seq_offsets, **gap_options)
    return skip + out(y)
