"""HSTU blocks over jagged sequences (Zhai et al., "Actions Speak Louder than Words", 2024).

One block, on the ``[L, D]`` values of a jagged batch::

    u, v, q, k = split(silu(W_uvqk · layer_norm(x)))
    a = jagged_attention(q, k, v)                  # pointwise silu attention, causal + targets
                                                   # (+ optional relative position / time bias)
    x = x + W_o · dropout(norm_gate(a, u))         # layer_norm(a) * u

The attention kernel may offer the whole block fused around its two linears
(:meth:`~gem_model.components.JaggedAttentionKernel.fused_block`); the block then hands it ``x`` and
the linears, and gets the block's output back. On that path the block is a
:class:`~gem_model.saved_format.SavedFormatBlock`: an activation policy may set ``saved_format``, and
the fused kernels then store what they save in it (when the kernel offers that format).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from gem_model.components import AttentionExtras, JaggedAttentionKernel, NormGateKernel

GATE_EPS = 1e-6
"""The ``eps`` of the norm-gate's layer norm."""
MIXER_SDPA_BACKENDS: list[SDPBackend] | None = None
"""The SDPA backends :class:`TokenMixer` may use; None: torch's own choice. Over the mixers' few tokens (5
and 7 in ``configs/h200-large.yaml``, 384 samples, 8 heads of 128) torch picks cuDNN on Hopper, and the
profiles of 2026-12-05 show its backward (a ``cutlass_75``/``cutlass_80`` GEMM, ``compute_dot_do_o``,
``convert_dq_to_16bits``) at 1.44 ms a step on the H100 and 0.67 ms on the H200, for a few MFLOP. The e2e
switch ``mixer_no_cudnn`` runs the mixers on flash, memory-efficient or math instead, and
``benchmarks/mixer_attention.py`` times each backend alone; neither has run on a GPU yet, so the default
is unchanged."""


class HSTUBlock(nn.Module):
    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        attention_dim: int,
        value_dim: int,
        max_seq_len: int,
        max_attn_len: int,
        alpha: float,
        dropout: float,
        attention: JaggedAttentionKernel,
        norm_gate: NormGateKernel,
        position_bias: bool = False,
        time_buckets: int = 0,
    ):
        super().__init__()
        self.num_heads, self.attention_dim, self.value_dim = num_heads, attention_dim, value_dim
        self.max_seq_len, self.max_attn_len, self.alpha = max_seq_len, max_attn_len, alpha
        self.attention, self.norm_gate = attention, norm_gate
        self.fuse = True  # use the attention kernel's fused block when it offers one (False: op by op)
        self.saved_format: str | None = None  # set by an activation policy (gem_model.saved_format)
        attention.fused_block(norm_gate)  # a kernel refuses a norm-gate it cannot fuse: when built
        self.uvqk = nn.Linear(dim, num_heads * (2 * value_dim + 2 * attention_dim))
        self.gate_weight = nn.Parameter(torch.ones(num_heads * value_dim))
        self.gate_bias = nn.Parameter(torch.zeros(num_heads * value_dim))
        self.out = nn.Linear(num_heads * value_dim, dim)
        self.dropout = nn.Dropout(dropout)
        # r[j - i] of the attention scores, shared by the heads (HSTU's relative position bias)
        self.position_bias = nn.Parameter(torch.zeros(2 * max_seq_len - 1)) if position_bias else None
        # r(bucket of t_query(i) - t_key(j)), shared by the heads (HSTU's relative time bias)
        self.time_bias = nn.Parameter(torch.zeros(time_buckets)) if time_buckets else None

    @property
    def fused(self) -> Callable[..., torch.Tensor] | None:
        """The whole block as one function around the linears, from the block's kernels as they are
        now (JaggedAttentionKernel.fused_block): a wrapper that replaces ``attention`` or
        ``norm_gate`` (tensor and context parallelism do) and offers none makes the block compose the
        ops; None also when ``fuse`` is off."""
        make = getattr(self.attention, "fused_block", None) if self.fuse else None
        return make(self.norm_gate) if make is not None else None

    def saves_in_kernels(self) -> bool:
        """Whether a forward now stores what the fused kernels save in ``saved_format``
        (:class:`~gem_model.saved_format.SavedFormatBlock`): the fused path, from a kernel that offers
        that format (``JaggedAttentionKernel.saved_formats``)."""
        return self._kernel_saved_format(self._fused_now()) is not None

    def _fused_now(self) -> Callable[..., torch.Tensor] | None:
        return None if torch.compiler.is_compiling() else self.fused

    def _kernel_saved_format(self, fused: Callable[..., torch.Tensor] | None) -> str | None:
        """``saved_format`` when the forward takes ``fused`` and its kernel stores that format, else None."""
        if fused is None or self.saved_format is None:
            return None
        return self.saved_format if self.saved_format in getattr(self.attention, "saved_formats", ()) else None

    def forward(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        num_targets: torch.Tensor | None,
        times: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``times``: ``(key, query)`` integer timestamps per row, needed when the block has a time bias."""
        n, h = x.shape[0], self.num_heads
        dv, dqk = self.value_dim, self.attention_dim
        key_times = query_times = None
        if self.time_bias is not None:
            if times is None:
                raise ValueError("an HSTU block with a time bias needs the rows' (key, query) timestamps")
            key_times, query_times = times
        extras = AttentionExtras(
            num_targets=num_targets, max_attn_len=self.max_attn_len, position_bias=self.position_bias,
            time_bias=self.time_bias, timestamps=key_times, query_timestamps=query_times,
        )
        fused = self._fused_now()
        if fused is not None:
            # the linear itself when dropout is off: then it may take the norm-gate's quantized rows
            # (gem_model.prequantized), which an active dropout would no longer match
            dropout_off = self.dropout.p == 0 or not self.training
            out = self.out if dropout_off else lambda y: self.out(self.dropout(y))
            # passed only when set: a fused block written before the argument existed still fits
            saved = self._kernel_saved_format(fused)
            return fused(
                x, self.uvqk, out, self.gate_weight, self.gate_bias,
                offsets, num_heads=h, attention_dim=dqk, value_dim=dv, max_seq_len=self.max_seq_len,
                alpha=self.alpha, eps=GATE_EPS, extras=extras, **({"saved_format": saved} if saved else {}),
            )
        pre = self.uvqk(F.layer_norm(x, x.shape[-1:]))
        u, v, q, k = torch.split(F.silu(pre), [h * dv, h * dv, h * dqk, h * dqk], dim=-1)
        attn = self.attention(
            q.reshape(n, h, dqk), k.reshape(n, h, dqk), v.reshape(n, h, dv), offsets,
            max_seq_len=self.max_seq_len, alpha=self.alpha, extras=extras,
        )
        y = self.norm_gate(attn.reshape(n, h * dv), u, self.gate_weight, self.gate_bias, GATE_EPS)
        return x + self.out(self.dropout(y)).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` that runs in its input's dtype: the float32 weight and bias are cast to it
    (torch's norm kernels accumulate the statistics in float32 for 16-bit inputs), so a bfloat16
    activation is normalised without a float32 copy of it. Parameter names are nn.LayerNorm's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class TokenMixer(nn.Module):
    """A pre-norm transformer layer over a fixed number of feature tokens ``[B, T, D]``."""

    def __init__(self, dim: int, num_heads: int, dropout: float):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"model.embedding_dim {dim} must be divisible by model.num_heads {num_heads}")
        self.num_heads = num_heads
        self.norm1 = LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.fc2 = nn.Linear(2 * dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.norm1(x)).reshape(b, t, 3, self.num_heads, d // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        a = _mixer_attention(q, k, v).transpose(1, 2).reshape(b, t, d)
        x = x + self.dropout(self.proj(a)).to(x.dtype)
        return x + self.dropout(self.fc2(F.gelu(self.fc1(self.norm2(x))))).to(x.dtype)


def _mixer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over the mixer's tokens, on :data:`MIXER_SDPA_BACKENDS` (the backward runs on the forward's)."""
    if MIXER_SDPA_BACKENDS is None:
        return F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel(MIXER_SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v)
