"""The sequence features re-split into even bags for the table lookup (gem_model.model.lookup_bags)."""

from __future__ import annotations

import pytest
import torch
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from gem_model import testing
from gem_model.config import ModelConfig
from gem_model.data.batch import SEQUENCE_KEYS, kjt_to
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.model.gem import GemModel
from gem_model.model.lookup_bags import bag_sizes, even_bags, lengths_by_key


def _kjt() -> KeyedJaggedTensor:
    # two samples; key "a" has 7 + 0 ids, "b" 1 + 1, "c" none at all
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b", "c"],
        values=torch.arange(100, 109),
        lengths=torch.tensor([7, 0, 1, 1, 0, 0]),
    )


def test_each_key_is_spread_over_the_same_number_of_even_bags_in_order():
    kjt = _kjt()
    even = even_bags(kjt, 3)  # 2 samples x 3 = 6 bags a key
    assert even.stride() == 6 and even.keys() == ["a", "b", "c"]
    assert torch.equal(even.values(), kjt.values())  # the ids, untouched and in order
    assert even.lengths().tolist() == [2, 2, 2, 1, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert even.length_per_key() == [7, 2, 0]
    for key in ("a", "b", "c"):  # each key's ids, as the lookup splits them
        assert torch.equal(even[key].values(), kjt[key].values())
    assert bag_sizes([7, 2, 0], 6) == [2, 1, 1]
    assert {k: v.tolist() for k, v in lengths_by_key(kjt).items()} == {"a": [7, 0], "b": [1, 1], "c": [0, 0]}


def test_bad_bag_counts_and_variable_batch_sizes_are_refused():
    with pytest.raises(ValueError, match=r"model\.lookup_bags_per_sample is 0; it must be at least 1"):
        even_bags(_kjt(), 0)
    with pytest.raises(ValueError, match="at least one is needed"):
        bag_sizes([3], 0)
    vbe = KeyedJaggedTensor(
        keys=["a", "b"], values=torch.arange(3), lengths=torch.tensor([1, 1, 1]), stride_per_key_per_rank=[[2], [1]]
    )
    with pytest.raises(ValueError, match="variable batch size per key"):
        even_bags(vbe, 2)
    with pytest.raises(ValueError):
        ModelConfig(lookup_bags_per_sample=0)


def test_a_batch_moved_off_the_host_is_re_split_without_reading_lengths_back():
    moved = kjt_to(_kjt(), torch.device("meta"))  # a device that has no numbers: any read would fail
    even = even_bags(moved, 4)
    assert even.stride() == 8 and even.lengths().shape == (24,) and even.lengths().device.type == "meta"
    assert even.length_per_key() == [7, 2, 0]


def _model(bags: int | None) -> GemModel:
    source = SyntheticSource(SyntheticConfig(max_len=31, num_negatives=3, length_exponent=0.3))
    return GemModel(ModelConfig(max_seq_len=32, lookup_bags_per_sample=bags), source.feature_spec(),
                    attention=testing.LoopAttention(), norm_gate=testing.TorchNormGate())  # fmt: skip


def test_the_model_gets_the_same_rows_lengths_and_table_gradients_from_even_bags():
    source = SyntheticSource(SyntheticConfig(max_len=31, num_negatives=3, length_exponent=0.3))
    batch = source.make_batch(0, 5, torch.arange(5))
    assert ModelConfig().lookup_bags_per_sample == 32  # on by default
    results = []
    for bags in (None, 4):
        model = _model(bags)
        seq, _ = model.sparse(batch.sequence, batch.pooled)
        g = torch.Generator().manual_seed(3)
        loss = sum((jt.values() * torch.randn(jt.values().shape, generator=g)).sum() for jt in seq.values())
        loss.backward()
        results.append((seq, {n: p.grad.clone() for n, p in model.sparse.ec.named_parameters()}))
    (whole, whole_grads), (even, even_grads) = results
    for key in SEQUENCE_KEYS:
        assert isinstance(even[key], JaggedTensor)
        assert torch.equal(whole[key].values(), even[key].values()), key
        assert torch.equal(even[key].lengths(), batch.sequence[key].lengths()), key
    assert whole_grads.keys() == even_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        assert grad.abs().sum() > 0 and torch.equal(grad, even_grads[name]), name
