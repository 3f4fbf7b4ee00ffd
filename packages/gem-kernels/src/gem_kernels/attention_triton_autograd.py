"""The autograd function over the Triton jagged attention kernels (imports triton)."""

from __future__ import annotations

from typing import Any, Literal

import torch

from gem_kernels import attention_triton, attention_triton_bwd
from gem_kernels.attention_triton import query_major
from gem_kernels.attention_triton_bwd import key_major

DqMode = Literal["atomic", "separate"]


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    # The kernels take any row and head strides but address the last dim directly.
    return x if x.stride(-1) == 1 else x.contiguous()


class JaggedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        num_targets: torch.Tensor | None,
        max_seq_len: int,
        alpha: float,
        max_attn_len: int,
        dq_mode: DqMode,
        blocks: tuple[int, int] | None,
    ) -> torch.Tensor:
        q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
        out = query_major(
            q, k, v, None, seq_offsets, num_targets,
            max_seq_len=max_seq_len, alpha=alpha, max_attn_len=max_attn_len, blocks=blocks,
        )
        ctx.save_for_backward(q, k, v, seq_offsets, num_targets)
        ctx.params = (max_seq_len, alpha, max_attn_len, dq_mode, blocks)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, seq_offsets, num_targets = ctx.saved_tensors
        max_seq_len, alpha, max_attn_len, dq_mode, blocks = ctx.params
        grad_out = _unit_stride(grad_out)
        options = dict(max_seq_len=max_seq_len, alpha=alpha, max_attn_len=max_attn_len, blocks=blocks)
        if dq_mode == "atomic":
            dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            dk, dv = key_major(q, k, v, grad_out, seq_offsets, num_targets, dq_accum, **options)
            dq = dq_accum.to(q.dtype)
        else:
            dk, dv = key_major(q, k, v, grad_out, seq_offsets, num_targets, None, **options)
            dq = query_major(q, k, v, grad_out, seq_offsets, num_targets, **options)
        return dq, dk, dv, None, None, None, None, None, None, None


def jagged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    *,
    max_seq_len: int,
    alpha: float,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
    dq_mode: DqMode = "atomic",
    blocks: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Differentiable jagged HSTU attention (see :mod:`gem_kernels.attention_triton`).

    ``blocks = (BLOCK_M, BLOCK_N)`` fixes the tile sizes instead of autotuning them.
    """
    seq_offsets = seq_offsets.contiguous()
    if num_targets is not None:
        num_targets = num_targets.contiguous()
    return JaggedAttentionFunction.apply(
        q, k, v, seq_offsets, num_targets, max_seq_len, alpha, max_attn_len, dq_mode, blocks
    )


def autotuned_configs() -> dict[str, str]:
    """What autotuning chose so far, per kernel and tuning key (for benchmark records)."""
    found = {}
    for kernel, tuners in (("query_major", attention_triton.TUNERS), ("key_major", attention_triton_bwd.TUNERS)):
        for tuner in tuners.values():
            for key, config in getattr(tuner, "cache", {}).items():
                found[f"{kernel}{key}"] = str(config)
    return found
