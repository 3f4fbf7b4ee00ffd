"""A deterministic synthetic source: Zipf item popularity, power-law history lengths, learnable labels.

Every global batch is a pure function of ``(seed, step)``, so any rank can rebuild any step and a
resumed run sees the same data as an uninterrupted one. Users have a favourite item cluster; their
histories and the click/conversion labels depend on it, so both the next-item loss and the task
heads have something to learn.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from gem_model.components import ComponentConfig, DataSource
from gem_model.data.batch import Batch, FeatureSpec, PooledFeature, build_batch
from gem_model.jagged import gather_rows, offsets_of


class SyntheticConfig(ComponentConfig):
    seed: int = 0
    num_items: int = Field(20_000, ge=2)
    num_actions: int = Field(4, ge=2, description="action types; 0 is reserved")
    num_users: int = Field(5_000, ge=1)
    num_segments: int = Field(16, ge=1)
    num_categories: int = Field(64, ge=1)
    num_advertisers: int = Field(256, ge=1)
    num_dense: int = Field(8, ge=2)
    num_clusters: int = Field(32, ge=1)
    favourite_share: float = Field(0.6, ge=0.0, le=1.0, description="share of history from the favourite cluster")
    zipf_exponent: float = Field(1.05, gt=0.0, description="item popularity ~ rank^-s")
    length_exponent: float = Field(0.8, ge=0.0, description="P(length = n) ~ (n + 1)^-a")
    min_len: int = Field(0, ge=0)
    max_len: int = Field(63, ge=1, description="longest history (the candidate comes on top)")
    num_negatives: int = Field(32, ge=1)


class SyntheticSource(DataSource):
    name: ClassVar[str] = "synthetic"
    Config = SyntheticConfig
    config: SyntheticConfig

    def __init__(self, config: SyntheticConfig | None = None):
        super().__init__(config)
        c = self.config
        if c.min_len > c.max_len:
            raise ValueError(f"data.source.options: min_len {c.min_len} > max_len {c.max_len}")
        ranks = torch.arange(1, c.num_items + 1, dtype=torch.float64)
        self._item_cdf = torch.cumsum(ranks.pow(-c.zipf_exponent), 0)
        self._item_cdf /= self._item_cdf[-1].clone()
        per_cluster = -(-c.num_items // c.num_clusters)
        crank = torch.arange(1, per_cluster + 1, dtype=torch.float64)
        self._cluster_cdf = torch.cumsum(crank.pow(-c.zipf_exponent), 0)
        self._cluster_cdf /= self._cluster_cdf[-1].clone()
        lens = torch.arange(c.min_len, c.max_len + 1, dtype=torch.float64)
        self._len_pmf = (lens + 1).pow(-c.length_exponent)
        self._cache: tuple[tuple[int, int], dict[str, torch.Tensor]] | None = None

    def feature_spec(self) -> FeatureSpec:
        c = self.config
        return FeatureSpec(
            num_items=c.num_items,
            num_actions=c.num_actions,
            pooled=(
                PooledFeature("user_id", c.num_users),
                PooledFeature("user_segment", c.num_segments),
                PooledFeature("ad_category", c.num_categories),
                PooledFeature("ad_advertiser", c.num_advertisers),
            ),
            num_dense=c.num_dense,
            tasks=("click", "conversion"),
            num_negatives=c.num_negatives,
            max_history=c.max_len,
            timestamps=False,
        )

    # ------------------------------------------------------------------------------------ sampling

    def _zipf(self, g: torch.Generator, n: int) -> torch.Tensor:
        return torch.searchsorted(self._item_cdf, torch.rand(n, generator=g, dtype=torch.float64)).clamp_(
            max=self.config.num_items - 1
        )

    def _in_cluster(self, g: torch.Generator, clusters: torch.Tensor) -> torch.Tensor:
        c = self.config
        rank = torch.searchsorted(self._cluster_cdf, torch.rand(clusters.numel(), generator=g, dtype=torch.float64))
        item = rank * c.num_clusters + clusters
        return torch.where(item < c.num_items, item, clusters % c.num_items)

    def _global(self, step: int, b: int) -> dict[str, torch.Tensor]:
        if self._cache is not None and self._cache[0] == (step, b):
            return self._cache[1]
        c = self.config
        g = torch.Generator().manual_seed(c.seed * 1_000_003 + step * 7_919 + 17)
        users = torch.randint(c.num_users, (b,), generator=g)
        favourite = (users * 2_654_435_761) % c.num_clusters
        lengths = c.min_len + torch.multinomial(self._len_pmf, b, replacement=True, generator=g)
        total = int(lengths.sum())
        owner = torch.repeat_interleave(torch.arange(b), lengths, output_size=total)
        from_fav = torch.rand(total, generator=g) < c.favourite_share
        history = torch.where(from_fav, self._in_cluster(g, favourite[owner]), self._zipf(g, total))
        actions = torch.randint(1, c.num_actions, (total,), generator=g)
        cand_fav = torch.rand(b, generator=g) < 0.5
        candidates = torch.where(cand_fav, self._in_cluster(g, favourite), self._zipf(g, b))
        match = (candidates % c.num_clusters == favourite).float()
        dense = torch.randn(b, c.num_dense, generator=g)
        click_logit = 2.5 * match - 1.25 + 0.8 * dense[:, 0]
        click = torch.bernoulli(torch.sigmoid(click_logit), generator=g)
        conv_logit = 1.5 * match - 1.0 + 0.8 * dense[:, 1]
        conversion = click * torch.bernoulli(torch.sigmoid(conv_logit), generator=g)
        data = {
            "users": users,
            "lengths": lengths,
            "history": history,
            "actions": actions,
            "negatives": torch.randint(c.num_items, (b, c.num_negatives), generator=g),
            "candidates": candidates,
            "dense": dense,
            "labels": torch.stack([click, conversion], 1),
        }
        self._cache = ((step, b), data)
        return data

    # ------------------------------------------------------------------------------- the interface

    def lengths(self, step: int, global_batch_size: int) -> torch.Tensor:
        return self._global(step, global_batch_size)["lengths"].clone()

    def make_batch(self, step: int, global_batch_size: int, indices: torch.Tensor) -> Batch:
        c = self.config
        d = self._global(step, global_batch_size)
        rows = gather_rows(offsets_of(d["lengths"]), d["lengths"], indices)
        users, cand = d["users"][indices], d["candidates"][indices]
        return build_batch(
            history=(d["history"][rows], d["lengths"][indices]),
            actions=d["actions"][rows],
            negatives=d["negatives"][indices],
            candidates=cand,
            pooled={
                "user_id": users,
                "user_segment": users % c.num_segments,
                "ad_category": cand % c.num_categories,
                "ad_advertiser": (cand * 7_919) % c.num_advertisers,
            },
            dense=d["dense"][indices],
            labels=d["labels"][indices],
            sample_ids=indices + step * global_batch_size,
        )
