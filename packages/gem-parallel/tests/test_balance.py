"""``seq_balanced``: properties of the partition (hypothesis), its cost model, packing and registration."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

import gem_parallel.plugin
from gem_model import testing
from gem_model.config import ModelConfig
from gem_model.config_io import load_config
from gem_model.data.loader import ShardedLoader
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.model.flops import count_flops
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components
from gem_parallel.balance import (
    SeqBalancedBalancer,
    SeqBalancedConfig,
    balanced_partition,
    cost_coefficients,
    lower_bound,
    max_over_mean,
    pack,
    pack_ranks,
)

SPEC = SyntheticSource(SyntheticConfig()).feature_spec()
GEM = ModelConfig(embedding_dim=2048, num_blocks=24, num_heads=32, attention_dim=128, value_dim=128, max_seq_len=4096)


def balancer(**options) -> SeqBalancedBalancer:
    b = SeqBalancedBalancer(SeqBalancedConfig(**options))
    if "attention_coef" not in options:
        b.bind_model(GEM, SPEC)
    return b


def zipf_lengths(n: int, *, alpha: float = 1.2, max_len: int = 4096, seed: int = 0) -> torch.Tensor:
    k = torch.arange(1, max_len + 1, dtype=torch.double)
    g = torch.Generator().manual_seed(seed)
    return torch.multinomial(k**-alpha, n, replacement=True, generator=g) + 1


batches = st.integers(1, 12).flatmap(
    lambda k: st.tuples(st.just(k), st.lists(st.integers(1, 4096), min_size=k, max_size=k * 12).map(lambda x: x[: len(x) - len(x) % k]))
)


@settings(max_examples=150, deadline=None)
@given(batches)
def test_every_sample_goes_to_exactly_one_rank_and_counts_are_equal(case):
    k, lengths = case
    plan = balancer().plan(torch.tensor(lengths), k)
    assert len(plan.per_rank) == k
    assert {p.numel() for p in plan.per_rank} == {len(lengths) // k}
    assert sorted(torch.cat(plan.per_rank).tolist()) == list(range(len(lengths)))


@settings(max_examples=150, deadline=None)
@given(batches)
def test_the_swap_pass_never_raises_the_heaviest_load(case):
    k, lengths = case
    costs = [float(n * n + 100 * n) for n in lengths]
    refined = balanced_partition(costs, k)
    unrefined = balanced_partition(costs, k, swap_pass=False)

    def heaviest(parts: list[list[int]]) -> float:
        return max(sum(costs[i] for i in p) for p in parts)

    assert heaviest(refined) <= heaviest(unrefined)
    # no rank can be lighter than the mean, nor lighter than its heaviest sample
    assert heaviest(refined) >= max(sum(costs) / k, max(costs)) * (1 - 1e-12)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 16), st.integers(1, 8), st.integers(1, 4096))
def test_equal_lengths_give_equal_loads(k, per_rank, n):
    plan = balancer().plan(torch.full((k * per_rank,), n), k)
    assert plan.load_after == pytest.approx(1.0) and plan.load_before == pytest.approx(1.0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 4096), min_size=8, max_size=64), st.integers(0, 2**31 - 1))
def test_the_split_depends_on_the_lengths_not_their_order(lengths, seed):
    lengths = lengths[: len(lengths) - len(lengths) % 4]
    b = balancer()
    t = torch.tensor(lengths)
    perm = torch.randperm(t.numel(), generator=torch.Generator().manual_seed(seed))
    costs = b.costs(t)
    a = b.plan(t, 4)
    p = b.plan(t[perm], 4)
    loads_a = sorted(float(costs[i].sum()) for i in a.per_rank)
    loads_p = sorted(float(costs[perm][i].sum()) for i in p.per_rank)
    assert loads_a == pytest.approx(loads_p)


@pytest.mark.parametrize("ranks", [8, 64, 1024])
def test_zipf_lengths_balance_within_two_percent_where_any_split_can(ranks):
    """The issue's target at 32 samples per rank (round robin is 1.3-3x off here). Where one sample
    alone outweighs an average rank (2 of 10 batches at 8 ranks) no split reaches 1.02: the plan
    must then reach that bound."""
    b = balancer()
    for seed in range(3 if ranks == 1024 else 10):
        plan = b.plan(zipf_lengths(32 * ranks, seed=seed), ranks)
        assert plan.load_after <= max(1.02, plan.load_bound * 1.001), (seed, plan.load_after, plan.load_bound)
        assert plan.load_before > 1.2


def test_the_bound_is_the_heaviest_sample_with_the_lightest_company():
    costs = torch.tensor([100.0, 1.0, 1.0, 2.0, 3.0, 5.0])  # 3 ranks of 2: mean 37.33
    assert lower_bound(costs, 3) == pytest.approx(101.0 / (112.0 / 3))
    assert lower_bound(torch.ones(6), 3) == 1.0


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4096))
def test_the_cost_is_the_models_flop_count(n):
    a, b = cost_coefficients(GEM, SPEC)
    one = count_flops(GEM, SPEC, torch.tensor([1])).train_step
    c = one - a - b
    assert count_flops(GEM, SPEC, torch.tensor([n])).train_step == pytest.approx(a * n * n + b * n + c, rel=1e-9)
    assert a > 0 and b > 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 64), min_size=1, max_size=40), st.integers(64, 256))
def test_micro_batches_hold_every_sample_within_the_budget(lengths, budget):
    t = torch.tensor(lengths)
    idx = torch.arange(len(lengths))
    micro = pack(t, idx, budget)
    assert micro is not None
    assert sorted(torch.cat(micro).tolist()) == list(range(len(lengths)))
    assert all(int(t[m].sum()) <= budget for m in micro)
    assert len(micro) <= 2 * -(-int(t.sum()) // budget)  # first fit uses at most twice the minimum


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 10), st.integers(0, 2**31 - 1), st.integers(4096, 20000))
def test_every_rank_gets_the_same_number_of_micro_batches(k, per_rank, seed, budget):
    lengths = zipf_lengths(k * per_rank, seed=seed)
    shards = list(torch.randperm(k * per_rank, generator=torch.Generator().manual_seed(seed)).view(k, per_rank))
    packed = pack_ranks(lengths, shards, budget)
    assert len({len(m) for m in packed}) == 1
    for idx, micro in zip(shards, packed, strict=True):
        assert sorted(torch.cat(micro).tolist()) == sorted(idx.tolist())
        assert all(0 < m.numel() and int(lengths[m].sum()) <= budget for m in micro)


def test_a_fixed_number_of_micro_batches_that_cannot_hold_the_samples_is_none():
    assert pack(torch.tensor([60, 60, 60]), torch.arange(3), 100, bins=2) is None
    assert [m.tolist() for m in pack(torch.tensor([60, 60, 30]), torch.arange(3), 100, bins=2)] == [[0, 2], [1]]


def test_packed_assignment_lists_micro_batch_after_micro_batch():
    b = balancer(micro_batch_tokens=8192)
    lengths = zipf_lengths(64, seed=3)
    plan = b.plan(lengths, 4)
    assert plan.micro_batches is not None
    for flat, micro in zip(plan.per_rank, plan.micro_batches, strict=True):
        assert torch.equal(flat, torch.cat(micro))
        assert all(int(lengths[m].sum()) <= 8192 for m in micro)


def test_unknown_options_are_refused_with_their_path():
    pm = GemPluginManager(autoload=False, plugins=[testing, gem_parallel.plugin])
    inline = ["kernels.jagged_attention=loop", "kernels.norm_gate=loop", "precision.scheme=inline_fp32",
              "activation.policy=inline_none", "comm.strategy=inline_comm"]
    cfg = load_config(overrides=[*inline, "data.balancer.name=seq_balanced", "data.balancer.options.alpha=2"])
    with pytest.raises(Exception, match=r"data\.balancer\.options\.alpha"):
        resolve_components(cfg, pm)


def test_a_sample_longer_than_the_budget_is_an_error():
    with pytest.raises(ValueError, match=r"micro_batch_tokens=100: sample 1 alone has 300 tokens \(1 samples exceed it\)"):
        pack(torch.tensor([10, 300, 20]), torch.arange(3), 100)


def test_explicit_coefficients_and_their_checks():
    b = balancer(attention_coef=1.0, linear_coef=0.0)
    assert b.costs(torch.tensor([3, 4])).tolist() == [9.0, 16.0]
    b.bind_model(GEM, SPEC)  # the config's coefficients win
    assert b.coefficients == (1.0, 0.0)
    with pytest.raises(ValidationError, match="given together"):
        SeqBalancedConfig(attention_coef=1.0)
    with pytest.raises(ValidationError, match="cannot both be 0"):
        SeqBalancedConfig(attention_coef=0.0, linear_coef=0.0)
    with pytest.raises(ValidationError, match="extra"):
        SeqBalancedConfig(alpha=1.0)


def test_without_coefficients_the_balancer_says_what_to_do():
    with pytest.raises(ValueError, match="no cost coefficients: give options attention_coef and linear_coef"):
        SeqBalancedBalancer().assign(torch.tensor([1, 2]), 2)


def test_uneven_batches_are_refused():
    with pytest.raises(ValueError, match="10 samples cannot be split evenly over 4 ranks"):
        balancer().assign(torch.ones(10, dtype=torch.long), 4)


def test_load_is_reported_before_and_after():
    b = balancer()
    lengths = zipf_lengths(256, seed=1)
    shards = b.assign(lengths, 8)
    assert b.last_plan is not None and b.last_plan.per_rank is shards
    costs = b.costs(lengths)
    assert b.last_plan.load_after == pytest.approx(max_over_mean(costs, shards))
    assert b.last_plan.load_before == pytest.approx(max_over_mean(costs, [torch.arange(r, 256, 8) for r in range(8)]))


def test_gem_parallel_registers_seq_balanced_and_a_run_config_selects_it():
    pm = GemPluginManager(autoload=False, plugins=[testing, gem_parallel.plugin])
    assert "seq_balanced" in pm.load_balancers.names()
    assert pm.load_balancers.get("seq_balanced").cls is SeqBalancedBalancer
    inline = ["kernels.jagged_attention=loop", "kernels.norm_gate=loop", "precision.scheme=inline_fp32",
              "activation.policy=inline_none", "comm.strategy=inline_comm"]
    cfg = load_config(overrides=[*inline, "data.balancer.name=seq_balanced",
                                 "data.balancer.options.attention_coef=1.0", "data.balancer.options.linear_coef=50.0"])
    built = resolve_components(cfg, pm).balancer
    assert isinstance(built, SeqBalancedBalancer) and built.coefficients == (1.0, 50.0)
    loader = ShardedLoader(SyntheticSource(SyntheticConfig()), built, global_batch_size=16, rank=1, world_size=4)
    assert loader.batch_at(0).history_lengths().numel() == 4


def test_a_run_binds_the_balancer_to_its_model(tmp_path):
    """``data.balancer=seq_balanced`` without coefficients trains: the run binds the balancer to its
    model before the first batch, with the coefficients of ``cost_coefficients`` for that model."""
    run = testing.tiny_run("data.balancer=seq_balanced", output_dir=tmp_path, steps=2, plugins=[gem_parallel.plugin])
    assert len(run.losses) == 2 and all(loss == loss for loss in run.losses)
