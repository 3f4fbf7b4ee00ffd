"""Analytic FLOP count of a training step, over real (unpadded) tokens.

Counts the GEMM-like work only (linears, attention products, the sampled-softmax dot products):
pointwise ops and embedding lookups are memory-bound and left out, as in the usual MFU convention.
Backward is twice the forward. Attention is counted either as the causal work the HSTU mask keeps
(``causal=True``, used for MFU) or as the full square per sequence that a dense per-sequence
implementation computes (``causal=False``, what ``FlopCounterMode`` sees on the reference kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gem_model.config import ModelConfig
from gem_model.data.batch import Batch, FeatureSpec


@dataclass(frozen=True)
class FlopCount:
    hstu_linear: float
    hstu_attention: float
    towers: float
    loss: float

    @property
    def forward(self) -> float:
        return self.hstu_linear + self.hstu_attention + self.towers + self.loss

    @property
    def train_step(self) -> float:
        return 3.0 * self.forward


def attention_pairs(lengths: torch.Tensor, *, causal: bool, num_targets: int = 0) -> float:
    """Number of (query, key) pairs attention computes over sequences of ``lengths``."""
    n = lengths.double()
    if not causal:
        return float((n * n).sum())
    t = torch.clamp(torch.full_like(n, float(num_targets)), max=n)
    hist = n - t
    # history: causal triangle incl. diagonal; each target: the history plus itself
    return float((hist * (hist + 1) / 2 + t * (hist + 1)).sum())


def count_flops(
    config: ModelConfig, spec: FeatureSpec, history_lengths: torch.Tensor, *, causal: bool = True
) -> FlopCount:
    """Forward FLOPs of one batch whose histories have ``history_lengths``."""
    d, h = config.embedding_dim, config.num_heads
    dqk, dv = config.attention_dim, config.value_dim
    b = history_lengths.numel()
    cand = 1 if config.use_candidate else 0
    lead = 1 if config.context_token else 0
    seq_lengths = history_lengths + cand + lead
    tokens = float(seq_lengths.sum())
    pairs = attention_pairs(seq_lengths, causal=causal, num_targets=cand)
    blocks = config.num_blocks
    hstu_linear = blocks * 2.0 * tokens * (d * h * (2 * dqk + 2 * dv) + h * dv * d)
    hstu_attention = blocks * 2.0 * pairs * h * (dqk + dv)

    side = config.use_side_features
    feat_tokens = (len(spec.pooled) + (1 if spec.num_dense else 0)) if side else 0
    n_tokens = 2 + feat_tokens

    def mixer(t: int) -> float:  # qkv, attention (qk and av), proj, 2-layer MLP with 2d hidden
        return b * (2.0 * t * d * 3 * d + 4.0 * t * t * d + 2.0 * t * d * d + 2 * 2.0 * t * d * 2 * d)

    towers = 0.0
    if lead:
        towers += 2.0 * b * feat_tokens * d * d  # the context token's projection
    if side and spec.num_dense:
        towers += 2.0 * b * spec.num_dense * d
    if side and feat_tokens:
        towers += config.interaction_layers * mixer(feat_tokens)
    towers += config.cross_layers * mixer(n_tokens)
    if spec.tasks:
        towers += 2.0 * b * (n_tokens * d * config.mlp_hidden + config.mlp_hidden * len(spec.tasks))
    queries = float(torch.clamp(history_lengths - 1, min=0).sum())
    loss = 2.0 * queries * spec.num_negatives * d
    return FlopCount(hstu_linear, hstu_attention, towers, loss)


def batch_flops(config: ModelConfig, spec: FeatureSpec, batch: Batch, *, causal: bool = True) -> FlopCount:
    return count_flops(config, spec, batch.history_lengths().cpu(), causal=causal)
