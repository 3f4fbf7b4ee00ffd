"""Timestamps in the batch and the model's relative time bias (HSTU's time half of the attention bias)."""

from __future__ import annotations

import pytest
import torch

from gem_model.config import ModelConfig
from gem_model.data.balance import RoundRobinBalancer
from gem_model.data.loader import ShardedLoader
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.data.validation import validate_batch
from gem_model.model.gem import GemModel
from gem_model.testing import LoopAttention, TorchNormGate


def movielens_model(src, **options) -> GemModel:
    cfg = ModelConfig(
        embedding_dim=8, num_blocks=2, num_heads=2, attention_dim=4, value_dim=4, max_seq_len=8,
        use_candidate=False, cross_layers=0, relative_time_bias=True, time_bias_buckets=40, **options,
    )
    return GemModel(cfg, src.feature_spec(), attention=LoopAttention(), norm_gate=TorchNormGate())


def test_by_default_the_request_time_is_the_last_items_not_the_targets(source):
    """The paper's protocol: the query at the last position never learns when the target was rated."""
    src = source(num_negatives=2, max_len=7)
    test = src.evaluation.eval_batch(torch.tensor([0, 1]), "test")
    assert test.timestamps.tolist() == [50, 100, 100, 150, 5, 10, 20] and test.request_times.tolist() == [150, 20]
    valid = src.evaluation.eval_batch(torch.tensor([0, 1]), "valid")
    assert valid.request_times.tolist() == [100, 10]
    train = src.make_batch(0, 3, torch.arange(3))
    last = {0: 100, 1: 10, 2: 4}
    assert train.request_times.tolist() == [last[u] for u in src.users_of_step(0, 3).tolist()]


def test_movielens_batches_carry_item_times_and_the_request_time(source):
    """User 1 rated B A C E D at 50 100 100 150 200, user 2 C F A B at 5 10 20 30 (movielens_cases)."""
    src = source(num_negatives=2, max_len=7, request_time="target")
    test = src.evaluation.eval_batch(torch.tensor([0, 1]), "test")
    assert test.timestamps.tolist() == [50, 100, 100, 150, 5, 10, 20] and test.request_times.tolist() == [200, 30]
    valid = src.evaluation.eval_batch(torch.tensor([0, 1]), "valid")
    assert valid.timestamps.tolist() == [50, 100, 100, 5, 10] and valid.request_times.tolist() == [150, 20]
    train = src.make_batch(0, 3, torch.arange(3))  # training reads the validation split's history
    users = src.users_of_step(0, 3).tolist()
    expected = {0: ([50, 100, 100], 150), 1: ([5, 10], 20), 2: ([1, 2, 3, 4], 5)}
    assert train.timestamps.tolist() == [t for u in users for t in expected[u][0]]
    assert train.request_times.tolist() == [expected[u][1] for u in users]
    validate_batch(train, src.feature_spec())
    train.request_times = train.request_times[:2]
    with pytest.raises(ValueError, match=r"times: .* expected one per history item \(9,\) and one per sample \(3,\)"):
        validate_batch(train, src.feature_spec())


@pytest.mark.parametrize(("request_time", "last"), [("target", (200, 30)), ("last_event", (150, 20))])
def test_each_position_queries_at_the_time_of_the_action_it_predicts(source, request_time, last):
    src = source(num_negatives=2, max_len=7, request_time=request_time)
    batch = src.evaluation.eval_batch(torch.tensor([0, 1]), "test")
    key, query = movielens_model(src)._history_times(batch, batch.history_lengths())
    assert key.tolist() == [50, 100, 100, 150, 5, 10, 20]
    # the next item's time; the request time last
    assert query.tolist() == [100, 100, 150, last[0], 10, 20, last[1]]


def test_context_token_and_candidate_rows_get_times():
    """Context token: the first item's time (the request time for an empty history); candidate: the
    request time, as key and as query."""
    src = SyntheticSource(SyntheticConfig(max_len=31, min_len=0, seed=3))
    batch = next(iter(ShardedLoader(src, RoundRobinBalancer(), global_batch_size=6)))
    lengths = batch.history_lengths()
    batch.timestamps = torch.randint(0, 10**6, (int(lengths.sum()),))
    batch.request_times = 2 * 10**6 + torch.arange(6)
    cfg = ModelConfig(max_seq_len=33, context_token=True, relative_time_bias=True)
    model = GemModel(cfg, src.feature_spec(), attention=LoopAttention(), norm_gate=TorchNormGate())
    seen = {}
    model.blocks[0].register_forward_pre_hook(lambda mod, args: seen.__setitem__("times", args[3]))
    model(batch)
    key, query = (t.tolist() for t in seen["times"])
    want_key, want_query = [], []
    for b, ts in enumerate(batch.timestamps.split(lengths.tolist())):
        ts, r = ts.tolist(), int(batch.request_times[b])
        first = ts[0] if ts else r
        want_key += [first, *ts, r]
        want_query += [first, *ts[1:], r, r] if ts else [first, r]
    assert key == want_key and query == want_query


def test_the_request_time_changes_only_its_own_query(source):
    src = source(num_negatives=2, max_len=7)
    torch.manual_seed(0)
    model = movielens_model(src).eval()
    batch = src.evaluation.eval_batch(torch.tensor([0, 1, 2]), "test")
    before = model.user_embeddings(batch)
    batch.request_times = batch.request_times + torch.tensor([10**7, 0, 0])
    after = model.user_embeddings(batch)
    assert not torch.allclose(before[0], after[0]) and torch.equal(before[1:], after[1:])


def test_time_bias_trains_and_needs_times_and_a_kernel_that_has_it(source):
    src = source(num_negatives=2, max_len=7)
    model = movielens_model(src)
    biases = [b.time_bias for b in model.blocks]
    assert all(p is not None and p.shape == (40,) and 0.005 < p.std().item() < 0.04 for p in biases)
    batch = src.make_batch(0, 3, torch.arange(3))
    model(batch).next_item_loss_sum.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in biases)
    batch.timestamps, batch.request_times = torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)
    with pytest.raises(ValueError, match="relative_time_bias needs timestamps in the batch"):
        model(batch)

    class NoTime(LoopAttention):
        name = "no_time"
        supports_time_bias = False

    cfg = ModelConfig(max_seq_len=8, relative_time_bias=True, use_candidate=False)
    with pytest.raises(ValueError, match="relative_time_bias needs an attention kernel .* 'no_time' does not"):
        GemModel(cfg, src.feature_spec(), attention=NoTime(), norm_gate=TorchNormGate())


def test_gather_bias_sums_the_gradient_per_entry_like_plain_indexing():
    from gem_model.jagged import gather_bias

    g = torch.Generator().manual_seed(0)
    table = torch.randn(40, generator=g, dtype=torch.float64, requires_grad=True)
    index = torch.randint(0, 40, (3, 50, 50), generator=g)
    index[0, 0, 0] = 39  # the last entry is hit, entry 7 never
    index[index == 7] = 8
    weight = torch.randn(3, 50, 50, generator=g, dtype=torch.float64)
    (got,) = torch.autograd.grad((gather_bias(table, index) * weight).sum(), table)
    (want,) = torch.autograd.grad((table[index] * weight).sum(), table)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got[7] == 0 and got[39] != 0
    assert torch.equal(gather_bias(table.detach(), index), table.detach()[index])
