"""The communication section: bytes per step per parallel dimension, from the planner's plan.

Counted per rank per step, in float32, for the algorithms NCCL and gloo run by default:

- a dense module ``replicated`` over dims of total degree ``w`` (DDP): a ring all-reduce of its
  gradients, ``2 (w - 1) / w x 4 x parameters``;
- ``fully_sharded`` (FSDP): an all-gather in forward and in backward and a reduce-scatter,
  ``3 (w - 1) / w x 4 x parameters``;
- a table sharded over ``w`` ranks: the embedding all-to-all of forward and of backward,
  ``2 (w - 1) / w x 4 x dim x lookups`` with the rank's lookups per step (item table: history,
  negatives and candidate ids; action table: history ids; a pooled table: one row per sample).

What a comm strategy does to these (quantized wires, hierarchical rings, overlap) is measured, not
modelled: a plugin's section (gem-comm) reports ``CommStrategy.measurements()`` of the real steps.
"""

from __future__ import annotations

import math

import torch

from gem_model.data.batch import ACTION_TABLE, ITEM_TABLE, FeatureSpec
from gem_model.plan import Plan
from gem_model.profiling.context import ProfileContext
from gem_model.profiling.report import ProfileSection, ProfileTable

FP32 = 4
DENSE_FACTORS = {"replicated": 2.0, "fully_sharded": 3.0}
UNSHARDED = ("unsharded", "data_parallel", "replicated")


def lookups_per_rank(spec: FeatureSpec, history: list[torch.Tensor], dp: int, cand: bool) -> dict[str, float]:
    """Mean rows looked up per rank per step, by table name."""
    n = len(history)
    hist = sum(float(h.sum()) for h in history) / n / dp
    samples = sum(h.numel() for h in history) / n / dp
    negatives = sum(float(spec.negatives_of(h).sum()) for h in history) / n / dp
    out = {ITEM_TABLE: hist + negatives + (samples if cand else 0.0), ACTION_TABLE: hist}
    out.update({f"t_{p.name}": samples for p in spec.pooled})
    return out


def bytes_per_dim(plan: Plan, lookups: dict[str, float]) -> dict[str, float]:
    degrees: dict[str, int] = plan.layout["degrees"]
    world = int(plan.layout["world_size"])
    out: dict[str, float] = {}
    for placement in plan.dense.values():
        factor = DENSE_FACTORS.get(placement.strategy)
        if factor is None or not placement.dims:
            continue
        w = math.prod(degrees.get(d, 1) for d in placement.dims)
        key = "dense " + "+".join(placement.dims)
        out[key] = out.get(key, 0.0) + (factor * (w - 1) / w * FP32 * placement.parameters if w > 1 else 0.0)
    for name, t in plan.tables.items():
        if t.sharding in UNSHARDED or world <= 1:
            continue
        w = world  # the all-to-all spans every rank, whichever of them hold the table's shards
        out["embedding all-to-all"] = out.get("embedding all-to-all", 0.0) + (
            2.0 * (w - 1) / w * FP32 * t.dim * lookups.get(name, 0.0)
        )
    return out


def comm_section(ctx: ProfileContext, plan: Plan, spec: FeatureSpec, history: list[torch.Tensor]) -> ProfileSection:
    lookups = lookups_per_rank(spec, history, ctx.dp_degree, ctx.config.model.use_candidate)
    per_dim = bytes_per_dim(plan, lookups)
    notes = []
    if not per_dim or not any(per_dim.values()):
        notes.append(f"{plan.layout['world_size']} rank(s) under {plan.planner}: no collectives move data per step")
    rows = [[k, v / 1e6] for k, v in sorted(per_dim.items())]
    return ProfileSection(
        name="communication",
        title="communication per rank per step (from the plan)",
        summary={"bytes_per_dim": per_dim, "planner": plan.planner, "world_size": plan.layout["world_size"]},
        tables=[ProfileTable(f"planner {plan.planner}, layout {plan.layout['degrees']}", ["dimension", "MB / step"], rows)],
        notes=notes,
    )
