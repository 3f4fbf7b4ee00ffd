"""The balance section: per-rank load under every registered load balancer.

Each balancer splits the same global batches (history lengths from the source) over the
data-parallel degree of the profile. A rank's load in a step is the training FLOPs of its samples
(:func:`gem_model.model.flops.count_flops`: linears linear in the length, attention quadratic), so
the slowest rank sets the step: ``imbalance`` is the mean over steps of ``max / mean`` rank load
(1.0: perfect), and ``step_efficiency = 1 / imbalance`` the share of the step every rank works.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gem_model.components import LoadBalancer
from gem_model.data.batch import FeatureSpec
from gem_model.model.flops import count_flops
from gem_model.profiling.context import ProfileContext
from gem_model.profiling.report import ProfileSection, ProfileTable, Recommendation
from gem_model.resolve import build_balancer


def rank_loads(
    balancer: LoadBalancer, history: list[torch.Tensor], world: int, load: Callable[[torch.Tensor], float]
) -> list[list[float]]:
    """Per step, per rank: ``load(history lengths of the rank's samples)``."""
    out = []
    for lengths in history:
        parts = balancer.assign(lengths, world)
        out.append([float(load(lengths[idx])) for idx in parts])
    return out


def imbalance(per_step: list[list[float]]) -> float:
    """Mean over steps of max / mean rank load (steps with no load are left out)."""
    ratios = [max(r) / (sum(r) / len(r)) for r in per_step if sum(r) > 0]
    return sum(ratios) / len(ratios) if ratios else 1.0


def balance_section(ctx: ProfileContext, history: list[torch.Tensor], spec: FeatureSpec) -> ProfileSection:
    world = ctx.dp_degree
    model = ctx.config.model

    def load(lengths: torch.Tensor) -> float:
        return count_flops(model, spec, lengths).train_step

    rows: list[list[object]] = []
    per_balancer: dict[str, list[float]] = {}
    ratios: dict[str, float] = {}
    notes = []
    for name in ctx.plugins.load_balancers.names():
        try:
            per_step = rank_loads(build_balancer(ctx.config, ctx.plugins, name, spec), history, world, load)
        except ValueError as exc:
            notes.append(f"{name}: {exc}")
            continue
        totals = [sum(step[r] for step in per_step) for r in range(world)]
        ratio = imbalance(per_step)
        ratios[name] = ratio
        per_balancer[name] = totals
        rows.append([name, ratio, 1.0 / ratio, max(totals) / 1e9, min(totals) / 1e9])
    configured = ctx.config.data.balancer.name
    recs = []
    if ratios and configured in ratios:
        best = min(ratios, key=lambda n: ratios[n])
        if ratios[best] < ratios[configured]:
            gain = 1.0 - ratios[best] / ratios[configured]
            recs.append(Recommendation(
                action=f"data.balancer={best}", expected_gain=gain, metric="step time (slowest rank's FLOPs)",
                evidence=f"max/mean rank load {ratios[configured]:.3f} under {configured} vs {ratios[best]:.3f} "
                f"under {best}, over {len(history)} batches on {world} data-parallel ranks",
            ))  # fmt: skip
    return ProfileSection(
        name="balance",
        title=f"balance over {world} data-parallel rank(s)",
        summary={"dp_degree": world, "configured": configured, "imbalance": ratios},
        tables=[ProfileTable("per-rank training FLOPs per balancer",
                      ["balancer", "max/mean", "step efficiency", "max rank GFLOP", "min rank GFLOP"], rows)],
        series={"rank_load": per_balancer},
        recommendations=recs,
        notes=notes,
    )
