"""The GEM model: jagged helpers, forward/backward, the analytic FLOP count."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from gem_model.config import ModelConfig
from gem_model.data.balance import RoundRobinBalancer
from gem_model.data.batch import FeatureSpec, build_batch
from gem_model.data.loader import ShardedLoader
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.data.validation import validate_batch
from gem_model.jagged import append_one, gather_rows, offsets_of, positions_in_sequence, prepend_one, split_rows
from gem_model.model.flops import attention_pairs, batch_flops
from gem_model.model.gem import GemModel
from gem_model.model.next_item import TorchNextItemLoss
from gem_model.model.sequence_input import position_rows
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


def test_insert_one_gradients_go_back_to_their_rows():
    """The inserted rows' gradient reaches ``extra``, every other row's its own value row, in both
    directions (append and prepend); the values' dtype is kept and a misshapen ``extra`` is refused."""
    gen = torch.Generator().manual_seed(3)
    lengths = torch.tensor([2, 0, 3, 1])
    # float64 rows of 3 move as 8-byte words, bf16 rows of 3 (6 bytes) element by element
    for at_start, dtype in ((False, torch.float64), (True, torch.float64), (False, torch.bfloat16)):
        values = torch.randn(6, 3, generator=gen).to(dtype).requires_grad_()
        extra = torch.randn(4, 3, generator=gen).to(dtype).requires_grad_()
        out, new_lengths = (prepend_one if at_start else append_one)(values, lengths, extra)
        grad = torch.randn(out.shape, generator=gen).to(dtype)
        out.backward(grad)
        inserted = (offsets_of(new_lengths)[:-1] if at_start else offsets_of(new_lengths)[1:] - 1).tolist()
        kept = [r for r in range(out.shape[0]) if r not in inserted]
        assert torch.equal(out[inserted].detach(), extra.detach()) and torch.equal(out[kept].detach(), values.detach())
        assert torch.equal(extra.grad, grad[inserted]) and torch.equal(values.grad, grad[kept])
    out, _ = append_one(values.detach().float(), lengths, extra.detach().double())  # extra takes the values' dtype
    assert out.dtype == torch.float32
    with pytest.raises(ValueError, match=r"extra must be \[4, \.\.\.\]"):
        append_one(values.detach(), lengths, extra.detach()[:3])


def test_split_rows_writes_each_gradient_row_once():
    """Both parts' gradients land in their rows of x's gradient (one part unused: zeros there); counts that
    do not cover the rows are refused."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    rows_a, rows_b = torch.tensor([0, 1, 3, 4, 5]), torch.tensor([2, 6])
    a, b = split_rows(x, rows_a, rows_b)
    assert torch.equal(a, x[rows_a]) and torch.equal(b, x[rows_b])
    ga, gb = torch.randn(a.shape, generator=gen, dtype=torch.float64), torch.randn(b.shape, generator=gen, dtype=torch.float64)
    (a * ga).sum().backward(retain_graph=True)
    expected = torch.zeros_like(x).index_copy_(0, rows_a, ga)
    assert torch.equal(x.grad, expected)
    x.grad = None
    (a * ga).sum().add((b * gb).sum()).backward()
    assert torch.equal(x.grad, expected.index_copy(0, rows_b, gb))
    with pytest.raises(ValueError, match="cover the 7 rows exactly once, got 5 \\+ 1"):
        split_rows(x, rows_a, rows_b[:1])


def test_position_rows_are_the_cast_rows_of_the_table():
    """The rows in bf16 are the float32 rows cast, and the table's gradient is summed in float32 (within
    one bf16 rounding of the float64 sum; the CPU path; the GPU's is checked on the device)."""
    gen = torch.Generator().manual_seed(5)
    table = torch.nn.Embedding(16, 8)
    torch.nn.init.normal_(table.weight, generator=gen)
    positions = torch.randint(16, (200,), generator=gen)
    got = position_rows(table.weight, positions, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, table(positions).to(torch.bfloat16))
    grad = torch.randn(200, 8, generator=gen).to(torch.bfloat16)
    got.backward(grad)
    expected = torch.zeros(16, 8, dtype=torch.float64).index_add_(0, positions, grad.double())
    assert float((table.weight.grad.double() - expected).norm() / expected.norm()) <= 1e-6
    assert torch.equal(position_rows(table.weight, positions, torch.float32), table(positions))


def test_forward_backward_reaches_every_parameter():
    model, data = build()
    out = model(next(data))
    assert out.task_logits.shape == (12, 2)
    (out.task_loss_sum + out.next_item_loss_sum).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


class TripledLoss(TorchNextItemLoss):
    """The core's loss times 3: shows which kernel the model called."""

    name = "tripled"

    def __call__(self, *args, **kwargs):
        total, count = super().__call__(*args, **kwargs)
        return total * 3.0, count


def test_the_next_item_loss_is_computed_by_the_models_kernel():
    model, data = build()
    assert type(model.loss_kernel) is TorchNextItemLoss  # not given: the core's torch kernel
    tripled = TripledLoss()
    src = SyntheticSource(SyntheticConfig(max_len=31))
    given = GemModel(ModelConfig(max_seq_len=32), src.feature_spec(), attention=LoopAttention(),
                     norm_gate=TorchNormGate(), next_item_loss=tripled)  # fmt: skip
    assert given.loss_kernel is tripled
    batch = next(data)
    model.eval()  # no dropout: the same forward twice
    torch_out = model(batch)
    model.loss_kernel = tripled
    tripled_out = model(batch)
    assert torch.equal(tripled_out.next_item_loss_sum, torch_out.next_item_loss_sum * 3.0)
    assert torch.equal(tripled_out.next_item_count, torch_out.next_item_count)


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


def _negatives_pair(per_position: bool, l2: bool) -> tuple[GemModel, FeatureSpec]:
    spec = FeatureSpec(
        num_items=20, num_actions=2, pooled=(), num_dense=0, tasks=(), num_negatives=3, max_history=8,
        negatives_per_position=per_position,
    )
    cfg = ModelConfig(
        embedding_dim=8, num_blocks=1, num_heads=2, attention_dim=4, value_dim=4, max_seq_len=8,
        use_candidate=False, use_side_features=False, cross_layers=0, l2_normalize=l2,
    )
    return GemModel(cfg, spec, attention=LoopAttention(), norm_gate=TorchNormGate(), seed=5), spec


@pytest.mark.parametrize("l2", [True, False])
def test_per_position_negatives_match_a_direct_computation(l2):
    """Each predicted position scores its own negatives; repeating the shared ones gives the shared loss."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 0, 4, 1])
    items = torch.randint(20, (int(lengths.sum()),), generator=g)
    items[1] = 7  # the positive of sample 0's first position ...
    shared = torch.randint(20, (4, 3), generator=g)
    shared[0, 1] = 7  # ... is also one of its negatives: that logit is masked
    rows = (lengths - 1).clamp(min=0)
    common = dict(history=(items, lengths), actions=torch.ones_like(items), candidates=None, pooled={},
                  dense=torch.zeros(4, 0), labels=torch.zeros(4, 0))
    shared_model, _ = _negatives_pair(False, l2)
    per_model, per_spec = _negatives_pair(True, l2)
    per_model.load_state_dict(shared_model.state_dict())
    tiled = (shared.repeat_interleave(rows, 0).reshape(-1), rows * 3)
    base = shared_model(build_batch(negatives=shared, **common))
    tiled_out = per_model(build_batch(negatives=tiled, **common))
    torch.testing.assert_close(tiled_out.next_item_loss_sum, base.next_item_loss_sum, rtol=1e-5, atol=1e-5)
    assert int(base.next_item_count) == int(rows.sum()) == 5

    own = torch.randint(20, (int(rows.sum()), 3), generator=g)
    batch = build_batch(negatives=(own.reshape(-1), rows * 3), **common)
    validate_batch(batch, per_spec)
    out = per_model(batch)
    enc = per_model.encode(batch)
    emb = per_model.sparse.item_table()
    norm = (lambda z: torch.nn.functional.normalize(z, dim=-1, eps=1e-6)) if l2 else (lambda z: z)
    expected, r = torch.zeros(()), 0
    for b, n in enumerate(lengths.tolist()):
        start = int(lengths[:b].sum())
        for p in range(n - 1):
            q, target = norm(enc["hist_out"][start + p]), int(items[start + p + 1])
            logits = [q @ norm(emb[target])] + [
                q @ norm(emb[j]) if j != target else torch.tensor(float("-inf")) for j in own[r].tolist()
            ]
            expected = expected + torch.logsumexp(torch.stack(logits) / 0.05, 0) - logits[0] / 0.05
            r += 1
    torch.testing.assert_close(out.next_item_loss_sum, expected, rtol=1e-4, atol=1e-4)
    bad = build_batch(negatives=(own.reshape(-1)[:-3], rows * 3 - torch.tensor([0, 0, 3, 0])), **common)
    with pytest.raises(ValueError, match="each predicted position needs exactly 3 negatives; sample 2 has 6, expected 9"):
        validate_batch(bad, per_spec)


def test_item_input_scale_and_initialisation_options():
    spec = FeatureSpec(num_items=50, num_actions=2, pooled=(), num_dense=0, tasks=(), num_negatives=2, max_history=60)
    cfg = ModelConfig(embedding_dim=64, num_blocks=2, max_seq_len=64, use_candidate=False, use_side_features=False,
                      cross_layers=0, position_init_std=0.5, uvqk_init_std=0.02, embedding_init_std=0.1)
    model = GemModel(cfg, spec, attention=LoopAttention(), norm_gate=TorchNormGate())
    assert model.position.weight.std().item() == pytest.approx(0.5, rel=0.05)
    assert all(b.uvqk.weight.std().item() == pytest.approx(0.02, rel=0.05) for b in model.blocks)
    for b in model.blocks:  # the out projection stays Xavier uniform: std = bound / sqrt(3)
        xavier = (6.0 / sum(b.out.weight.shape)) ** 0.5 / 3**0.5
        assert b.out.weight.std().item() == pytest.approx(xavier, rel=0.1)
    assert model.sparse.item_table().std().item() == pytest.approx(0.1, rel=0.05)
    # scale_item_input multiplies the item embeddings entering the sequence by sqrt(D): with the position
    # embedding and dropout off, the first block's input is exactly that
    seen = {}
    for scale in (False, True):
        m = GemModel(cfg.model_copy(update={"scale_item_input": scale, "position_embedding": False}), spec,
                     attention=LoopAttention(), norm_gate=TorchNormGate())
        m.blocks[0].register_forward_pre_hook(lambda mod, args, s=scale: seen.__setitem__(s, args[0].detach()))
        items = torch.tensor([3, 4, 5])
        m.eval().encode(build_batch(history=(items, torch.tensor([3])), actions=torch.ones_like(items),
                                    negatives=torch.zeros(1, 2, dtype=torch.long), candidates=None, pooled={},
                                    dense=torch.zeros(1, 0), labels=torch.zeros(1, 0)))
        action = m.sparse.ec.embeddings["action"].weight[1]
        torch.testing.assert_close(seen[scale] - action, m.sparse.item_table()[items] * (8.0 if scale else 1.0))


def test_relative_position_bias_trains_and_needs_a_kernel_that_has_it():
    cfg = ModelConfig(max_seq_len=32, relative_position_bias=True)
    model, data = build(cfg)
    biases = [b.position_bias for b in model.blocks]
    assert all(p is not None and p.shape == (63,) and 0.01 < p.std().item() < 0.03 for p in biases)
    out = model(next(data))
    (out.task_loss_sum + out.next_item_loss_sum).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in biases)

    class NoBias(LoopAttention):
        name = "no_bias"
        supports_position_bias = False

    spec = SyntheticSource(SyntheticConfig(max_len=31)).feature_spec()
    with pytest.raises(ValueError, match="relative_position_bias needs an attention kernel .* 'no_bias' does not"):
        GemModel(cfg, spec, attention=NoBias(), norm_gate=TorchNormGate())


def test_device_table_init_builds_on_meta_and_draws_within_the_host_bounds():
    from gem_model.model.embeddings import SparseArch, table_bound

    spec = SyntheticSource(SyntheticConfig(num_items=500, num_users=50)).feature_spec()
    arch = SparseArch(spec, 16, seed=3, on_meta=True)
    assert arch.on_meta and all(p.is_meta for p in arch.parameters())
    arch.materialize_on(torch.device("cpu"), seed=3)
    assert not arch.on_meta
    for name, p in arch.named_parameters():
        bound = table_bound(p.shape[0])
        assert not p.is_meta and float(p.abs().max()) <= bound, name
        assert float(p.std()) > bound / 4, name  # drawn, not left empty or zero
    again = SparseArch(spec, 16, seed=3, on_meta=True)
    again.materialize_on(torch.device("cpu"), seed=3)
    for (name, a), (_, b) in zip(arch.named_parameters(), again.named_parameters(), strict=True):
        assert torch.equal(a, b), name  # seeded
    with pytest.raises(ValueError, match="cannot take model.embedding_init_std"):
        SparseArch(spec, 16, sequence_init_std=0.02, on_meta=True)
