"""The sequences section: how long the sequences are, what padding would waste, how tokens vary.

Lengths are those of the sequences the HSTU blocks run over: the history plus the candidate
(``model.use_candidate``) plus the context token (``model.context_token``), read from the data
source for ``batches`` global batches from step 0 (:meth:`DataSource.lengths`, no batch is built).

- Histogram: ``bins`` bins of equal integer width ``w = ceil((max + 1) / bins)``; bin ``i`` counts
  lengths in ``[i w, (i + 1) w)``.
- Percentiles: linear interpolation between order statistics (``torch.quantile``).
- Padding waste to the maximum: per global batch, every sequence padded to that batch's longest;
  waste = padded tokens that are not real / padded tokens, over all batches.
- Padding waste to buckets: every sequence padded to the smallest bucket edge at or above its
  length (edges: the powers of two below the longest length, and the longest length).
- Attention work: causal (query, key) pairs of the real sequences against the ``n x max`` square
  per batch that a padded dense kernel computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gem_model.components import DataSource
from gem_model.config import ModelConfig
from gem_model.model.flops import attention_pairs
from gem_model.profiling.context import ProfileContext
from gem_model.profiling.report import ProfileSection, ProfileTable, Recommendation

PERCENTILES = (0.5, 0.9, 0.99, 1.0)


def model_lengths(history: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """History lengths -> the lengths of the sequences the blocks see."""
    return history.long() + int(config.use_candidate) + int(config.context_token)


@dataclass(frozen=True)
class Histogram:
    width: int
    counts: list[int]

    @property
    def edges(self) -> list[int]:
        return [i * self.width for i in range(len(self.counts) + 1)]


def length_histogram(lengths: torch.Tensor, bins: int = 20) -> Histogram:
    top = int(lengths.max()) if lengths.numel() else 0
    width = max(1, math.ceil((top + 1) / bins))
    counts = torch.bincount(lengths.long() // width, minlength=math.ceil((top + 1) / width))
    return Histogram(width, [int(c) for c in counts])


def percentiles(lengths: torch.Tensor, qs: tuple[float, ...] = PERCENTILES) -> dict[str, float]:
    values = lengths.double()
    return {f"p{round(q * 100)}": float(torch.quantile(values, q)) for q in qs}


def padding_waste_to_max(batches: list[torch.Tensor]) -> float:
    """Fraction of padded tokens that are padding, each batch padded to its own longest sequence."""
    real = sum(float(b.sum()) for b in batches)
    padded = sum(float(b.max()) * b.numel() for b in batches if b.numel())
    return 1.0 - real / padded if padded else 0.0


def bucket_edges(longest: int) -> list[int]:
    """Powers of two below ``longest``, then ``longest`` itself."""
    edges, e = [], 1
    while e < longest:
        edges.append(e)
        e *= 2
    return [*edges, max(longest, 1)]


def padding_waste_to_buckets(lengths: torch.Tensor, edges: list[int]) -> float:
    """Fraction of padded tokens that are padding, each sequence padded up to its bucket's edge."""
    bounds = torch.tensor(edges, dtype=torch.long)
    idx = torch.searchsorted(bounds, lengths.long())  # first edge >= length
    if int(idx.max()) >= len(edges):
        raise ValueError(f"a length {int(lengths.max())} exceeds the largest bucket edge {edges[-1]}")
    padded = float(bounds[idx].sum())
    return 1.0 - float(lengths.sum()) / padded if padded else 0.0


def token_stats(batches: list[torch.Tensor]) -> dict[str, float]:
    tokens = torch.tensor([float(b.sum()) for b in batches], dtype=torch.float64)
    mean = float(tokens.mean())
    var = float(tokens.var(unbiased=False)) if tokens.numel() > 1 else 0.0
    return {"tokens_per_batch_mean": mean, "tokens_per_batch_var": var,
            "tokens_per_batch_cv": math.sqrt(var) / mean if mean else 0.0}  # fmt: skip


def read_history(ctx: ProfileContext, source: DataSource) -> list[torch.Tensor]:
    """History lengths of ``ctx.batches`` global batches of ``source``, from step 0."""
    b = ctx.config.data.global_batch_size
    return [source.lengths(step, b) for step in range(ctx.batches)]


def sequences_section(ctx: ProfileContext, history: list[torch.Tensor]) -> ProfileSection:
    batches = [model_lengths(h, ctx.config.model) for h in history]
    lengths = torch.cat(batches)
    hist = length_histogram(lengths)
    pct = percentiles(lengths)
    edges = bucket_edges(int(lengths.max()))
    waste_max = padding_waste_to_max(batches)
    waste_buckets = padding_waste_to_buckets(lengths, edges)
    cand = int(ctx.config.model.use_candidate)
    real_pairs = sum(attention_pairs(b, causal=True, num_targets=cand) for b in batches)
    padded_pairs = sum(float(b.max()) ** 2 * b.numel() for b in batches)
    summary = {
        "batches": len(batches), "samples": int(lengths.numel()), "mean_length": float(lengths.double().mean()),
        **pct, "padding_waste_to_max": waste_max, "padding_waste_to_buckets": waste_buckets,
        "bucket_edges": edges, "attention_pairs_real": real_pairs, "attention_pairs_padded": padded_pairs,
        **token_stats(batches),
    }  # fmt: skip
    rows = [[k, v] for k, v in pct.items()]
    rows += [["mean", summary["mean_length"]], ["padding waste, to the longest", f"{100 * waste_max:.1f} %"],
             ["padding waste, to power-of-two buckets", f"{100 * waste_buckets:.1f} %"],
             ["tokens per global batch", f"{summary['tokens_per_batch_mean']:,.0f} "
              f"(cv {summary['tokens_per_batch_cv']:.3f})"],
             ["attention pairs, real (causal) / padded", f"{real_pairs:,.0f} / {padded_pairs:,.0f}"]]  # fmt: skip
    recs = []
    if padded_pairs > 0 and real_pairs < padded_pairs:
        recs.append(Recommendation(
            action="keep a jagged attention kernel (kernels.jagged_attention=triton on GPU), never pad to the longest",
            expected_gain=1.0 - real_pairs / padded_pairs, metric="attention work",
            evidence=f"real causal pairs {real_pairs:,.0f} vs {padded_pairs:,.0f} padded; "
            f"padding to the longest wastes {100 * waste_max:.1f} % of tokens",
        ))  # fmt: skip
    return ProfileSection(
        name="sequences",
        title="sequences",
        summary=summary,
        tables=[ProfileTable(f"lengths over {len(batches)} global batch(es) of {ctx.config.data.global_batch_size}",
                      ["statistic", "value"], rows)],
        series={"histogram_edges": hist.edges, "histogram_counts": hist.counts},
        recommendations=recs,
        notes=["lengths include the candidate and context tokens the blocks see"],
    )
