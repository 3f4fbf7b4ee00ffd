"""Pure-torch references: the definitions the tests and benchmarks compare every kernel against.

They favour plainness over speed: the attention reference pads the whole batch to its longest
sequence and materialises every ``[B, H, n, n]`` score matrix. Both compute in at least float32
(float64 inputs stay float64) and return the dtype of their input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gem_model.api import NO_EXTRAS, AttentionExtras, relative_bias_matrix, time_bias_matrix


def effective_positions(lengths: torch.Tensor, num_targets: torch.Tensor | None, size: int) -> torch.Tensor:
    """``p(i) = min(i, n - t)`` for ``i < size`` and every sequence: int64 ``[B, size]``."""
    positions = torch.arange(size, device=lengths.device)
    history = lengths if num_targets is None else lengths - num_targets.to(lengths.dtype)
    return torch.minimum(positions[None, :], history[:, None].to(torch.int64))


def attention_mask(
    lengths: torch.Tensor, num_targets: torch.Tensor | None, max_attn_len: int, size: int
) -> torch.Tensor:
    """Bool ``[B, size, size]``: row ``i`` may attend to column ``j`` (KERNELS.md).

    ``i == j`` or ``0 < p(i) - p(j) <= W`` (no upper limit when ``W == 0``), restricted to rows and
    columns inside the sequence.
    """
    p = effective_positions(lengths, num_targets, size)
    # compared without materialising the int64 [B, size, size] difference (8 bytes per pair: 14 GB at
    # size 30,000 for two sequences); each comparison below is one bool per pair
    allowed = p[:, :, None] > p[:, None, :]
    if max_attn_len > 0:
        allowed &= p[:, None, :] >= (p - max_attn_len)[:, :, None]
    allowed |= torch.eye(size, dtype=torch.bool, device=lengths.device)
    inside = torch.arange(size, device=lengths.device)[None, :] < lengths[:, None]
    return allowed & inside[:, :, None] & inside[:, None, :]


def jagged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    *,
    max_seq_len: int,
    alpha: float,
    extras: AttentionExtras = NO_EXTRAS,
) -> torch.Tensor:
    """``out_i = sum_j mask(i, j) * silu(alpha * <q_i, k_j> + r(i, j)) / max_seq_len * v_j`` per sequence.

    ``r(i, j) = position_bias[j - i + max_seq_len - 1] + time_bias[bucket(query_timestamps[i] - timestamps[j])]``
    (each term 0 when its bias is None). Differentiable in ``q``, ``k``, ``v`` and both biases. Pads to
    the longest sequence of the batch.
    """
    num_targets, max_attn_len = extras.num_targets, extras.max_attn_len
    position_bias, time_bias = extras.position_bias, extras.time_bias
    timestamps, query_timestamps = extras.timestamps, extras.query_timestamps
    compute = torch.promote_types(v.dtype, torch.float32)
    num_rows, num_heads, _ = q.shape
    offsets = seq_offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    num_seqs = lengths.numel()
    size = int(lengths.max()) if num_seqs > 0 else 0
    seq_of_row = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), lengths)
    pos_of_row = torch.arange(num_rows, device=q.device) - offsets[seq_of_row]

    def pad(x: torch.Tensor) -> torch.Tensor:  # [L, H, D] -> [B, H, size, D]
        out = x.new_zeros((num_seqs, size, num_heads, x.shape[-1]), dtype=compute)
        return out.index_put((seq_of_row, pos_of_row), x.to(compute)).transpose(1, 2)

    scores = alpha * pad(q) @ pad(k).transpose(-1, -2)
    if position_bias is not None:
        scores = scores + relative_bias_matrix(position_bias.to(compute), size, max_seq_len)
    if time_bias is not None:
        assert timestamps is not None and query_timestamps is not None, "time_bias needs both timestamp vectors"
        times = [
            t.new_zeros(num_seqs, size).index_put((seq_of_row, pos_of_row), t) for t in (query_timestamps, timestamps)
        ]
        scores = scores + time_bias_matrix(time_bias.to(compute), *times)[:, None]
    mask = attention_mask(lengths, num_targets, max_attn_len, size)[:, None]
    weights = torch.where(mask, F.silu(scores), 0.0) / max_seq_len
    out = (weights @ pad(v)).transpose(1, 2)  # [B, size, H, Dv]
    return out[seq_of_row, pos_of_row].to(v.dtype)


def norm_gate_reference(
    x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """``(layer_norm(x) * weight + bias) * u`` over the last dim, computed in at least float32."""
    compute = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(compute)
    mean = xf.mean(-1, keepdim=True)
    var = (xf - mean).square().mean(-1, keepdim=True)
    normed = (xf - mean) * torch.rsqrt(var + eps)
    return ((normed * weight.to(compute) + bias.to(compute)) * u.to(compute)).to(x.dtype)
