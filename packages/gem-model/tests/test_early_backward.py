"""``trainer.early_backward``: the backward before the loss check, with fused tables updated only after it
(gem_model.train.early_backward)."""

from __future__ import annotations

import types

import torch

from gem_model import testing
from gem_model.config import ModelConfig
from gem_model.data.balance import RoundRobinBalancer
from gem_model.data.loader import ShardedLoader
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.model.gem import GemModel
from gem_model.testing import LoopAttention, TorchNormGate
from gem_model.train.early_backward import EarlyBackward, device_loss


class _Optimizers:
    """What EarlyBackward reads of the run's optimizers: whether the tables' update is fused, zero_grad."""

    def __init__(self, model: torch.nn.Module, fused: bool):
        self.sparse_fused, self.model = fused, model

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)


def _model_and_batch() -> tuple[GemModel, object]:
    src = SyntheticSource(SyntheticConfig(max_len=31, seed=3))
    model = GemModel(ModelConfig(max_seq_len=32), src.feature_spec(), attention=LoopAttention(), norm_gate=TorchNormGate())
    return model, next(ShardedLoader(src, RoundRobinBalancer(), global_batch_size=8))


def _loss(model: GemModel, batch: object) -> torch.Tensor:
    out = model(batch)
    return out.task_loss_sum / 8 + out.next_item_loss_sum / out.next_item_count.clamp(min=1)


def test_fused_tables_are_reached_only_after_the_check() -> None:
    """The first backward fills every dense gradient and no table's; finish() then gives the tables
    bitwise the gradients of one plain backward (the dense ones too: nothing differs)."""
    model, batch = _model_and_batch()
    _loss(model, batch).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    tables = {n for n in want if n.startswith("sparse.")}
    assert tables and len(want) > len(tables)
    model.zero_grad(set_to_none=True)

    early = EarlyBackward(model, _Optimizers(model, fused=True))
    early.switch(True)
    _loss(model, batch).backward()  # what the pipeline's backward runs before the check
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want) - tables  # no table touched: their backward waits behind the cut
    assert sum(len(a.cut) for a in early.arches) > 0
    early.finish()
    for name, grad in want.items():
        assert torch.equal(model.get_parameter(name).grad, grad), name
    assert all(not a.cut for a in early.arches)


def test_discard_forgets_the_first_backward() -> None:
    model, batch = _model_and_batch()
    early = EarlyBackward(model, _Optimizers(model, fused=True))
    early.switch(True)
    _loss(model, batch).backward()
    early.discard()  # a skipped step
    assert all(p.grad is None for p in model.parameters())
    assert all(not a.cut for a in early.arches)
    early.finish()  # nothing left to carry
    assert all(p.grad is None for p in model.parameters())


def test_without_fused_tables_nothing_is_cut() -> None:
    """Tables updated by their optimizer's step: the whole backward may run before the check."""
    model, batch = _model_and_batch()
    early = EarlyBackward(model, _Optimizers(model, fused=False))
    early.switch(True)
    assert early.arches == []
    _loss(model, batch).backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("sparse."))


def test_off_leaves_the_graph_whole() -> None:
    model, batch = _model_and_batch()
    early = EarlyBackward(model, _Optimizers(model, fused=True))
    early.switch(True)
    early.switch(False)
    _loss(model, batch).backward()
    assert all(not a.cut for a in early.arches)
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("sparse."))


def test_device_loss_is_the_host_formula() -> None:
    """The loss built from the reduced sums on the device equals, bit for bit, the one from their host copies."""
    gen = torch.Generator().manual_seed(0)
    out = types.SimpleNamespace(task_loss_sum=torch.rand((), generator=gen) * 37, next_item_loss_sum=torch.rand((), generator=gen) * 91)
    for count in (0.0, 1.0, 177.0):
        local = torch.tensor([0.0, 0.0, count, 13.0, 0.0], dtype=torch.float64)
        for ranks in (1, 3):
            host = 0.7 * out.task_loss_sum / (13.0 / ranks) + 1.3 * (out.next_item_loss_sum / (max(count, 1.0) / ranks))
            assert torch.equal(device_loss(out, local, ranks, 0.7, 1.3), host)


def test_training_is_the_same_either_way(tmp_path) -> None:
    """Four tiny steps with early backward (the default) and without: the same losses, bit for bit."""
    early = testing.tiny_run(output_dir=tmp_path / "early", steps=4)
    late = testing.tiny_run("trainer.early_backward=false", output_dir=tmp_path / "late", steps=4)
    assert early.losses == late.losses and len(early.losses) == 4
