"""``seq_balanced``: the samples of a global batch split over the data-parallel ranks by work, not count.

A sample of history length ``n`` costs ``a * n**2 + b * n`` FLOPs (attention is quadratic in the
length, the linears linear); :func:`cost_coefficients` reads ``a`` and ``b`` off
:func:`gem_model.model.flops.count_flops` for a model config. The split is the balanced form of
Karmarkar-Karp's largest differencing method (Michiels, Aarts, Korst and van Leeuwen 2003; verl's
``karmarkar_karp(equal_size=True)``): the samples, sorted by cost, are cut into rows of
``world_size``; each row is a partial partition with one sample per rank; the two partitions of
largest spread (heaviest minus lightest rank) are merged heaviest-with-lightest until one remains.
Because each rank then holds one sample of every cost row, a rank with a very long sample cannot
take only tiny ones beside it; a swap pass follows that trades samples between the heaviest rank
and the lightest ones while that lowers the heaviest load. Every rank gets exactly ``global_batch_size / world_size`` samples, as the loader (and torchrec's
fixed-size all-to-all) expects.

Optionally each rank's samples are packed into micro-batches of at most ``micro_batch_tokens``
tokens, the same number on every rank (longest first); ``assign`` then returns them micro-batch after micro-batch, and
:attr:`SeqBalancedBalancer.last_plan` says where each begins.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import Field, model_validator

from gem_model.api import ComponentConfig, FeatureSpec, LoadBalancer, ModelConfig, count_flops


def cost_coefficients(model: ModelConfig, spec: FeatureSpec) -> tuple[float, float]:
    """``(a, b)`` with a training step's FLOPs of one sample of length ``n`` = ``a*n**2 + b*n + c``.

    Exact: :func:`~gem_model.model.flops.count_flops` is a quadratic in ``n`` for ``n >= 1``.
    """
    f1, f2, f3 = (count_flops(model, spec, torch.tensor([n])).train_step for n in (1, 2, 3))
    a = (f3 - 2 * f2 + f1) / 2
    return a, (f2 - f1) - 3 * a


class SeqBalancedConfig(ComponentConfig):
    attention_coef: float | None = Field(
        None, ge=0, description="a in a*len^2 + b*len; None: from the model (bind_model), see cost_coefficients"
    )
    linear_coef: float | None = Field(None, ge=0, description="b in a*len^2 + b*len; given together with attention_coef")
    micro_batch_tokens: int | None = Field(
        None, gt=0, description="pack each rank's samples into micro-batches of at most this many tokens; None: one"
    )

    @model_validator(mode="after")
    def _both_or_neither(self) -> SeqBalancedConfig:
        if (self.attention_coef is None) != (self.linear_coef is None):
            raise ValueError("attention_coef and linear_coef are given together, or both left to the model")
        if self.attention_coef == 0 and self.linear_coef == 0:
            raise ValueError("attention_coef and linear_coef cannot both be 0: every sample would cost nothing")
        return self


@dataclass(frozen=True)
class BalancePlan:
    per_rank: list[torch.Tensor]
    """Sample indices of each rank (micro-batch after micro-batch when packed)."""
    load_before: float
    """max / mean of the ranks' cost under round-robin assignment of the same batch."""
    load_after: float
    """max / mean of the ranks' cost under this plan."""
    load_bound: float
    """No split with equal counts does better: max / mean of (the largest sample plus the
    ``per_rank - 1`` smallest), or 1. Above 1 when one sample outweighs an average rank."""
    micro_batches: list[list[torch.Tensor]] | None = None
    """Per rank, its micro-batches (when ``micro_batch_tokens`` is set)."""


def max_over_mean(costs: torch.Tensor, per_rank: list[torch.Tensor]) -> float:
    loads = torch.stack([costs[idx].sum() for idx in per_rank])
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def lower_bound(costs: torch.Tensor, k: int) -> float:
    """max / mean that no split of ``costs`` into ``k`` equal-count parts can beat."""
    c, _ = torch.sort(costs.double())
    mean = float(c.sum()) / k
    if mean <= 0:
        return 1.0
    m = c.numel() // k
    return max(1.0, (float(c[-1]) + float(c[: m - 1].sum())) / mean)


def balanced_partition(costs: list[float], k: int, *, swap_pass: bool = True) -> list[list[int]]:
    """Indices of ``costs`` in ``k`` parts of ``len(costs) / k`` each, by balanced largest differencing
    (then :func:`refine`, unless ``swap_pass`` is False)."""
    n = len(costs)
    if n % k:
        raise ValueError(f"{n} samples cannot be split evenly over {k} ranks")
    c = torch.tensor(costs, dtype=torch.float64)
    order = torch.sort(c, descending=True, stable=True).indices
    tie = itertools.count()
    # a partial partition: the load of each of its k parts and their members ([k, rows merged])
    heap: list[tuple[float, int, torch.Tensor, torch.Tensor]] = []
    for row in order.view(n // k, k):
        heapq.heappush(heap, (-float(c[row[0]] - c[row[-1]]), next(tie), c[row], row.view(k, 1)))
    while len(heap) > 1:
        _, _, sums_a, members_a = heapq.heappop(heap)
        _, _, sums_b, members_b = heapq.heappop(heap)
        heavy_first = torch.sort(sums_a, descending=True, stable=True).indices
        light_first = torch.sort(sums_b, stable=True).indices  # heaviest of one with the lightest of the other
        sums = sums_a[heavy_first] + sums_b[light_first]
        members = torch.cat([members_a[heavy_first], members_b[light_first]], dim=1)
        heapq.heappush(heap, (-float(sums.max() - sums.min()), next(tie), sums, members))
    parts = heap[0][3].tolist()
    if swap_pass:
        refine(parts, costs)
    return [sorted(p) for p in parts]


def refine(
    parts: list[list[int]], costs: list[float], *, candidates: int = 8, tolerance: float = 1e-3, max_swaps: int = 100_000
) -> None:
    """Lower the heaviest part's load by one-for-one swaps with the lightest parts, in place.

    Each swap moves ``delta = c_x - c_y`` (``x`` from the heaviest part, ``y`` from a light one) with
    ``0 < delta < load_heavy - load_light``, chosen to make the two loads as even as possible; it
    stops when the heaviest load is within ``tolerance`` of the mean, or when no swap with any of the
    ``candidates`` lightest parts lowers it. Sample counts never change.
    """
    k = len(parts)
    members = [sorted((costs[i], i) for i in p) for p in parts]
    loads = [sum(c for c, _ in m) for m in members]
    load_t = torch.tensor(loads, dtype=torch.float64)  # the same loads, for argmax / topk in C
    few = min(candidates, k)
    good_enough = (1.0 + tolerance) * sum(loads) / k
    for _ in range(max_swaps):
        h = int(torch.argmax(load_t))
        if loads[h] <= good_enough:
            break
        best: tuple[float, int, int, int] | None = None  # (new max of the pair, light part, x pos, y pos)
        for light in torch.topk(load_t, few, largest=False).indices.tolist():
            gap = loads[h] - loads[light]
            if gap <= 0:
                continue
            ys = [c for c, _ in members[light]]
            for xi, (cx, _) in enumerate(members[h]):
                want = cx - gap / 2  # the y that would even the two loads exactly
                j = bisect.bisect_left(ys, want)
                for yi in (j - 1, j):
                    if 0 <= yi < len(ys):
                        delta = cx - ys[yi]
                        if 0 < delta < gap:
                            pair_max = max(loads[h] - delta, loads[light] + delta)
                            if best is None or pair_max < best[0]:
                                best = (pair_max, light, xi, yi)
        if best is None:
            break
        _, light, xi, yi = best
        x, y = members[h].pop(xi), members[light].pop(yi)
        bisect.insort(members[h], y)
        bisect.insort(members[light], x)
        delta = x[0] - y[0]
        loads[h] -= delta
        loads[light] += delta
        load_t[h], load_t[light] = loads[h], loads[light]
    for p, m in zip(parts, members, strict=True):
        p[:] = [i for _, i in m]


def pack(lengths: torch.Tensor, indices: torch.Tensor, token_budget: int, bins: int | None = None) -> list[torch.Tensor] | None:
    """``indices`` in micro-batches of at most ``token_budget`` tokens, longest first.

    ``bins`` None: first fit, as few micro-batches as it finds. ``bins`` given: exactly that many,
    each sample into the emptiest one (so none stays empty while ``bins <= len(indices)``); None when
    they cannot hold the samples.
    """
    lens = lengths[indices].tolist()
    too_long = [(int(indices[j]), n) for j, n in enumerate(lens) if n > token_budget]
    if too_long:
        i, n = too_long[0]
        raise ValueError(
            f"data.balancer.options.micro_batch_tokens={token_budget}: sample {i} alone has {n} tokens "
            f"({len(too_long)} samples exceed it); raise the budget"
        )
    order = sorted(range(len(lens)), key=lambda j: (-lens[j], j))
    if bins is None:
        used: list[int] = []
        members: list[list[int]] = []
        for j in order:
            b = next((b for b, u in enumerate(used) if u + lens[j] <= token_budget), len(used))
            if b == len(used):
                used.append(0)
                members.append([])
            used[b] += lens[j]
            members[b].append(int(indices[j]))
    else:
        used, members = [0] * bins, [[] for _ in range(bins)]
        for j in order:
            b = min(range(bins), key=lambda b: (used[b], b))
            if used[b] + lens[j] > token_budget:
                return None
            used[b] += lens[j]
            members[b].append(int(indices[j]))
    return [torch.tensor(sorted(m), dtype=torch.long) for m in members]


def pack_ranks(lengths: torch.Tensor, per_rank: list[torch.Tensor], token_budget: int) -> list[list[torch.Tensor]]:
    """Every rank's samples in the same number of micro-batches (a synchronous step runs as many
    forward passes on each rank): the most that first fit needs on any rank, more if the emptiest-bin
    packing of some rank needs them."""
    count = max(len(pack(lengths, idx, token_budget) or ()) for idx in per_rank)
    while True:
        packed = [pack(lengths, idx, token_budget, bins=count) for idx in per_rank]
        if all(p is not None for p in packed):
            return packed  # type: ignore[return-value]
        count += 1


class SeqBalancedBalancer(LoadBalancer):
    """Equal sample counts per rank, equal attention-aware work per rank."""

    name: ClassVar[str] = "seq_balanced"
    Config = SeqBalancedConfig
    config: SeqBalancedConfig

    def __init__(self, config: SeqBalancedConfig | None = None):
        super().__init__(config)
        c = self.config
        self.coefficients: tuple[float, float] | None = (
            None if c.attention_coef is None else (c.attention_coef, c.linear_coef or 0.0)
        )
        self.last_plan: BalancePlan | None = None

    def bind_model(self, model: ModelConfig, spec: FeatureSpec) -> None:
        """Take ``a`` and ``b`` from the model's FLOP count (unless the config gives them)."""
        if self.config.attention_coef is None:
            self.coefficients = cost_coefficients(model, spec)

    def costs(self, lengths: torch.Tensor) -> torch.Tensor:
        if self.coefficients is None:
            raise ValueError(
                "data.balancer 'seq_balanced' has no cost coefficients: give options attention_coef and "
                "linear_coef (gem_parallel.balance.cost_coefficients(model, spec) computes them from "
                "gem_model.model.flops), or call bind_model(model, spec) before the first batch"
            )
        a, b = self.coefficients
        n = lengths.double()
        return a * n * n + b * n

    def plan(self, lengths: torch.Tensor, world_size: int) -> BalancePlan:
        b = lengths.numel()
        if b % world_size:
            raise ValueError(f"data.global_batch_size: {b} samples cannot be split evenly over {world_size} ranks")
        costs = self.costs(lengths)
        parts = balanced_partition(costs.tolist(), world_size)
        per_rank = [torch.tensor(p, dtype=torch.long) for p in parts]
        before = max_over_mean(costs, [torch.arange(r, b, world_size) for r in range(world_size)])
        micro = None
        if self.config.micro_batch_tokens is not None:
            micro = pack_ranks(lengths, per_rank, self.config.micro_batch_tokens)
            per_rank = [torch.cat(m) for m in micro]
        return BalancePlan(per_rank, before, max_over_mean(costs, per_rank), lower_bound(costs, world_size), micro)

    def assign(self, lengths: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        self.last_plan = self.plan(lengths, world_size)
        return self.last_plan.per_rank
