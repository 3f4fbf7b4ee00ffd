"""The GEM model: jagged helpers, forward/backward, the analytic FLOP count."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

from gem_model.config import ModelConfig
from gem_model.data.balance import RoundRobinBalancer
from gem_model.data.loader import ShardedLoader
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.jagged import append_one, gather_rows, offsets_of, positions_in_sequence
from gem_model.model.flops import attention_pairs, batch_flops
from gem_model.model.gem import GemModel
from gem_model.testing import LoopAttention, TorchNormGate


def build(cfg: ModelConfig | None = None, **data):
    src = SyntheticSource(SyntheticConfig(**{"max_len": 31, **data}))
    cfg = cfg or ModelConfig(max_seq_len=32)
    model = GemModel(cfg, src.feature_spec(), attention=LoopAttention(), norm_gate=TorchNormGate())
    return model, ShardedLoader(src, RoundRobinBalancer(), global_batch_size=12)


def test_jagged_helpers():
    lengths = torch.tensor([2, 0, 3])
    values = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])
    out, new_len = append_one(values, lengths, torch.tensor([[10.0], [20.0], [30.0]]))
    assert out.squeeze(1).tolist() == [1, 2, 10, 20, 3, 4, 5, 30] and new_len.tolist() == [3, 1, 4]
    assert positions_in_sequence(lengths).tolist() == [0, 1, 0, 1, 2]
    assert gather_rows(offsets_of(lengths), lengths, torch.tensor([2, 0])).tolist() == [2, 3, 4, 0, 1]


def test_forward_backward_reaches_every_parameter():
    model, data = build()
    out = model(next(data))
    assert out.task_logits.shape == (12, 2)
    (out.task_loss_sum + out.next_item_loss_sum).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_candidate_sees_history_and_history_never_sees_candidate():
    """Changing the candidate changes the task logits but no next-item term (targets come last)."""
    model, data = build()
    batch = next(data)
    a = model(batch)
    seq = batch.sequence
    values = seq.values().clone()
    values[-seq["cand_item"].values().numel() :] = (seq["cand_item"].values() + 7) % model.spec.num_items
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    batch.sequence = KeyedJaggedTensor(keys=seq.keys(), values=values, lengths=seq.lengths())
    b = model(batch)
    assert torch.allclose(a.next_item_loss_sum, b.next_item_loss_sum, rtol=1e-6)
    assert not torch.allclose(a.task_logits, b.task_logits)


def test_ids_only_model_without_candidate_or_side_features():
    cfg = ModelConfig(max_seq_len=32, use_candidate=False, use_side_features=False)
    model, data = build(cfg)
    out = model(next(data))
    assert out.next_item_count > 0 and torch.isfinite(out.next_item_loss_sum)
    assert model.num_tokens == 2


def test_flop_count_matches_flop_counter_within_5_percent():
    """FlopCounterMode sees the full n x n products of the per-sequence kernel: compare with causal=False."""
    model, data = build(ModelConfig(max_seq_len=32, num_blocks=2, cross_layers=2))
    batch = next(data)
    with FlopCounterMode(display=False) as counter:
        model(batch)
    measured = counter.get_total_flops()
    analytic = batch_flops(model.config, model.spec, batch, causal=False).forward
    assert abs(analytic - measured) / measured < 0.05, (analytic, measured)


def test_causal_pairs_count_the_hstu_mask():
    # n = 4 with one target: history of 3 -> 6 causal pairs; the target sees 3 history + itself
    assert attention_pairs(torch.tensor([4]), causal=True, num_targets=1) == 10
    assert attention_pairs(torch.tensor([4, 0]), causal=False) == 16
