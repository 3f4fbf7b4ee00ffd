"""Synthetic source, balancer, sharded loader and the batch checks."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model.data.balance import RoundRobinBalancer
from gem_model.data.batch import SEQ_ITEM, Batch
from gem_model.data.loader import ShardedLoader
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.data.validation import validate_batch


def loader(rank=0, world=1, b=32, **opts) -> ShardedLoader:
    return ShardedLoader(
        SyntheticSource(SyntheticConfig(**opts)), RoundRobinBalancer(), global_batch_size=b, rank=rank, world_size=world
    )


def seq_of(batch: Batch, key: str = SEQ_ITEM) -> list[list[int]]:
    return [t.tolist() for t in batch.sequence[key].to_dense()]


def test_same_seed_same_batches_other_seed_other_batches():
    a, b, c = loader(seed=3), loader(seed=3), loader(seed=4)
    for _ in range(3):
        x, y, z = next(a), next(b), next(c)
        assert seq_of(x) == seq_of(y) and torch.equal(x.labels, y.labels)
    assert seq_of(x) != seq_of(z)


def test_item_popularity_is_zipf_and_lengths_are_power_law():
    src = SyntheticSource(SyntheticConfig(num_items=1000, favourite_share=0.0, zipf_exponent=1.2, max_len=200, length_exponent=1.0))
    batch = src.make_batch(0, 4096, torch.arange(4096))
    counts = torch.bincount(batch.sequence[SEQ_ITEM].values(), minlength=1000).double()
    # rank-1 item vs rank-10 item: expected ratio 10^1.2 ~ 15.8
    assert 10 < counts[0] / counts[9] < 25
    lengths = src.lengths(0, 4096).double()
    # P(n) ~ 1/(n+1): short histories dominate, long ones still occur
    assert (lengths < 10).double().mean() > 0.35 and (lengths > 100).double().mean() > 0.05
    assert int(lengths.max()) <= 200


def test_ranks_partition_the_global_batch():
    whole = loader(b=8).batch_at(5)
    parts = [loader(rank=r, world=2, b=8).batch_at(5) for r in range(2)]
    ids = sorted(torch.cat([p.sample_ids for p in parts]).tolist())
    assert ids == whole.sample_ids.tolist()
    rows = {int(i): s for p in parts for i, s in zip(p.sample_ids, seq_of(p), strict=True)}
    assert [rows[int(i)] for i in whole.sample_ids] == seq_of(whole)


def test_uneven_split_is_an_error():
    with pytest.raises(ValueError, match="cannot be split evenly over 3 ranks"):
        loader(world=3, b=8).batch_at(0)


def test_position_saves_and_restores():
    a = loader()
    for _ in range(4):
        next(a)
    state = a.state_dict()
    expected = next(a)
    b = loader()
    b.load_state_dict(state)
    assert seq_of(next(b)) == seq_of(expected)
    with pytest.raises(ValueError, match="global_batch_size 32"):
        loader(b=16).load_state_dict(state)


def test_empty_histories_are_valid():
    batch = loader(min_len=0, max_len=1, length_exponent=0.0).batch_at(0)
    assert (batch.history_lengths() == 0).any()
    validate_batch(batch, loader(max_len=1).spec)


def _with_sequence(batch: Batch, values: torch.Tensor, lengths: torch.Tensor) -> Batch:
    seq = batch.sequence
    return Batch(
        KeyedJaggedTensor(keys=seq.keys(), values=values, lengths=lengths), batch.pooled, batch.dense, batch.labels
    )


def test_out_of_range_id_names_feature_table_value_and_range():
    good = loader(num_items=50).batch_at(0)
    values = good.sequence.values().clone()
    values[0] = 50
    with pytest.raises(ValueError) as err:
        validate_batch(_with_sequence(good, values, good.sequence.lengths()), loader(num_items=50).spec)
    msg = str(err.value)
    assert "'seq_item'" in msg and "'item'" in msg and "id 50" in msg and "[0, 49]" in msg


def test_negative_id_in_a_pooled_feature():
    good = loader().batch_at(0)
    values = good.pooled.values().clone()
    values[0] = -3
    pooled = KeyedJaggedTensor(keys=good.pooled.keys(), values=values, lengths=good.pooled.lengths())
    bad = Batch(good.sequence, pooled, good.dense, good.labels)
    with pytest.raises(ValueError, match=r"feature 'user_id': id -3 is outside table 't_user_id'"):
        validate_batch(bad, loader().spec)


def test_negative_lengths_and_inconsistent_offsets():
    good = loader().batch_at(0)
    lengths = good.sequence.lengths().clone()
    lengths[0], lengths[1] = -1, lengths[1] + lengths[0] + 1
    with pytest.raises(ValueError, match="negative length -1"):
        validate_batch(_with_sequence(good, good.sequence.values(), lengths), loader().spec)
    short = good.sequence.values()[:-1]
    with pytest.raises(ValueError, match="lengths add up to"):
        validate_batch(_with_sequence(good, short, good.sequence.lengths()), loader().spec)
    seq = good.sequence
    offsets = seq.offsets().clone()
    offsets[1] += 1
    bad = KeyedJaggedTensor(keys=seq.keys(), values=seq.values(), offsets=offsets, lengths=seq.lengths())
    with pytest.raises(ValueError, match="offsets .* do not match the lengths"):
        validate_batch(Batch(bad, good.pooled, good.dense, good.labels), loader().spec)


def test_round_robin_assignment():
    parts = RoundRobinBalancer().assign(torch.arange(6), 3)
    assert [p.tolist() for p in parts] == [[0, 3], [1, 4], [2, 5]]
