"""The trainer end to end on inline plugins: learning, metrics, resume, NaN stop, lifecycle hooks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torchrec.optim import optimizers as torchrec_optimizers
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from gem_model import hookimpl
from gem_model.config import TrainerConfig
from gem_model.config_io import load_config
from gem_model.errors import NonFiniteLossError
from gem_model.train.checkpoint import latest_checkpoint
from gem_model.train.optim import SPARSE_OPTIMIZERS, sparse_optimizer_spec
from gem_model.trainer import train


def losses(output_dir: Path) -> list[float]:
    return [json.loads(line)["step_loss"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def test_training_lowers_the_loss_and_writes_metrics(pm, tiny_overrides, tmp_path, capsys):
    cfg = load_config(None, [*tiny_overrides, "trainer.steps=25", "trainer.log_every=5"])
    summary = train(cfg, pm)
    assert summary.last_loss < summary.first_loss
    records = [json.loads(x) for x in (tmp_path / "gem-tiny" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [5, 10, 15, 20, 25]
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in records)
    out = capsys.readouterr().out
    assert "== summary" in out and "tokens / s" in out and "MFU" in out


@pytest.mark.parametrize("sparse_optimizer", sorted(SPARSE_OPTIMIZERS))
def test_resumed_run_continues_with_identical_losses(pm, tiny_overrides, tmp_path, sparse_optimizer):
    common = [*tiny_overrides, f"trainer.sparse_optimizer={sparse_optimizer}"]
    if sparse_optimizer == "adam":
        common.append("trainer.sparse_lr=0.003")
    train(load_config(None, [*common, f"trainer.output_dir={tmp_path}/a", "trainer.steps=6"]), pm)
    train(load_config(None, [*common, f"trainer.output_dir={tmp_path}/b", "trainer.steps=3"]), pm)
    train(load_config(None, [*common, f"trainer.output_dir={tmp_path}/b", "trainer.steps=6", "trainer.resume=true"]), pm)
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(b) == 6 and a[-1] < a[0]
    assert a == b  # bit-identical: model, both optimizers, data position and RNG all restored


def test_sparse_optimizers_by_name():
    tc = TrainerConfig(sparse_lr=0.01, sparse_eps=1e-7, betas=(0.8, 0.9))
    adagrad = sparse_optimizer_spec(tc)
    assert adagrad.cls is RowWiseAdagrad and adagrad.fused() == (RowWiseAdagrad, {"lr": 0.01, "eps": 1e-7})
    adam = sparse_optimizer_spec(tc.model_copy(update={"sparse_optimizer": "adam"}))
    assert adam.cls is torch.optim.Adam and adam.kwargs == {"lr": 0.01, "betas": (0.8, 0.9), "eps": 1e-7}
    assert adam.fused() == (torchrec_optimizers.Adam, {"lr": 0.01, "beta1": 0.8, "beta2": 0.9, "eps": 1e-7})
    sgd = sparse_optimizer_spec(tc.model_copy(update={"sparse_optimizer": "sgd"}))
    assert sgd.cls is torch.optim.SGD and sgd.fused() == (torch.optim.SGD, {"lr": 0.01}) and sgd.fused_on_cpu
    with pytest.raises(ValidationError, match="sparse_optimizer"):
        TrainerConfig(sparse_optimizer="lamb")


def test_resume_with_dropout_restores_the_rng(pm, tiny_overrides, tmp_path):
    common = [*tiny_overrides, "model.dropout=0.3"]
    train(load_config(None, [*common, f"trainer.output_dir={tmp_path}/a", "trainer.steps=4"]), pm)
    train(load_config(None, [*common, f"trainer.output_dir={tmp_path}/b", "trainer.steps=2"]), pm)
    train(load_config(None, [*common, f"trainer.output_dir={tmp_path}/b", "trainer.steps=4", "trainer.resume=true"]), pm)
    assert losses(tmp_path / "a") == losses(tmp_path / "b")


def test_nan_loss_stops_with_the_step_and_keeps_the_last_checkpoint(pm, tiny_overrides, tmp_path):
    # 1 block -> one attention call per step; NaN from the 4th step (index 3)
    cfg = load_config(
        None,
        [*tiny_overrides, "kernels.jagged_attention=poison", "kernels.jagged_attention.options.nan_from_call=4",
         "trainer.checkpoint_every=2", "trainer.steps=10"],
    )
    with pytest.raises(NonFiniteLossError, match=r"step 4 \(rank 0\): the loss is nan") as err:
        train(cfg, pm)
    ckpts = tmp_path / "gem-tiny" / "checkpoints"
    last = latest_checkpoint(ckpts)
    assert last is not None and last.name == "step_00000002" and str(last) in str(err.value)
    assert json.loads((last / "meta.json").read_text())["step"] == 2
    assert not any(p.name.endswith(".partial") for p in ckpts.iterdir())


def test_lifecycle_hooks_see_the_run(pm, tiny_overrides, capsys):
    """A plugin object registered directly (not through ``callbacks:``) sees every lifecycle hook."""
    from gem_model.testing import Recorder

    rec = Recorder()
    pm.register(rec, name="recorder")
    train(load_config(None, [*tiny_overrides, "trainer.steps=2"]), pm)
    assert rec.events == ["started 0", "step 0", "step 1", "finished 2"]
    out = capsys.readouterr().out
    assert "== recorder" in out and "steps seen" in out


def test_activation_and_precision_plans_follow_the_config(pm, tiny_overrides):
    from gem_model.testing import HalfGemm

    HalfGemm.converted.clear()
    cfg = load_config(
        None,
        [*tiny_overrides, "trainer.steps=1", "precision.overrides={'blocks.*': inline_bf16}", "precision.exclude=['task_head.*']"],
    )
    train(cfg, pm)
    assert HalfGemm.converted == ["blocks.0.uvqk", "blocks.0.out"]


def test_source_evaluation_runs_during_and_after_training(pm, tiny_overrides, tmp_path, capsys):
    from gem_model.data.synthetic import SyntheticSource

    class Scored(SyntheticSource):
        name = "scored"
        calls: list[tuple[str, bool]] = []

        def evaluate(self, model, *, device, split):
            Scored.calls.append((split, model.training))
            return {"hr@10": 0.25}

    pm.register(type("P", (), {"gem_register_data_sources": hookimpl(lambda self: [Scored])})(), name="scored")
    train(load_config(None, [*tiny_overrides, "data.source.name=scored", "trainer.steps=4", "trainer.eval_every=2"]), pm)
    assert Scored.calls == [("valid", False), ("valid", False), ("test", False)]
    records = [json.loads(x) for x in (tmp_path / "gem-tiny" / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 2, "valid/hr@10": 0.25} in records and records[-1] == {"step": 4, "valid/hr@10": 0.25, "test/hr@10": 0.25}
    assert "test/hr@10" in capsys.readouterr().out


def test_a_fresh_run_never_overwrites_an_earlier_runs_checkpoints(pm, tiny_overrides, tmp_path):
    from gem_model.errors import CheckpointError

    train(load_config(None, [*tiny_overrides, "trainer.steps=2"]), pm)
    before = sorted(p.name for p in (tmp_path / "gem-tiny" / "checkpoints").iterdir())
    with pytest.raises(CheckpointError, match="set trainer.resume=true"):
        train(load_config(None, [*tiny_overrides, "trainer.steps=4", "trainer.resume=false"]), pm)
    assert sorted(p.name for p in (tmp_path / "gem-tiny" / "checkpoints").iterdir()) == before


def test_time_limit_stops_after_the_step_that_crosses_it(pm, tiny_overrides, tmp_path):
    summary = train(load_config(None, [*tiny_overrides, "trainer.steps=50", "trainer.time_limit_s=1e-9"]), pm)
    assert summary.steps == 1
    assert [json.loads(x)["step"] for x in (tmp_path / "gem-tiny" / "metrics.jsonl").read_text().splitlines()] == [1]
    assert latest_checkpoint(tmp_path / "gem-tiny" / "checkpoints").name == "step_00000001"


def test_sequence_tables_can_start_from_a_normal_distribution(pm, tiny_overrides):
    from gem_model.data.synthetic import SyntheticSource
    from gem_model.model.embeddings import SparseArch

    spec = SyntheticSource().feature_spec()
    arch = SparseArch(spec, 16, seed=0, sequence_init_std=0.3)
    std = arch.ec.embeddings["item"].weight.std().item()
    assert abs(std - 0.3) < 0.01
    assert arch.ebc.embedding_bags["t_user_id"].weight.abs().max() <= 0.05


class LearningRates:
    def __init__(self):
        self.dense: list[float] = []
        self.sparse: list[float] = []

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        result = yield
        self.dense.append(run.optimizers.dense.param_groups[0]["lr"])
        self.sparse.append(run.optimizers.sparse.param_groups[0]["lr"])
        return result


def test_warmup_ramps_both_learning_rates_and_survives_a_resume(pm, tiny_overrides, tmp_path):
    rates = LearningRates()
    pm.register(rates, name="rates")
    common = [*tiny_overrides, "trainer.warmup_steps=4", "trainer.dense_lr=0.004", "trainer.sparse_lr=0.04"]
    train(load_config(None, [*common, f"trainer.output_dir={tmp_path}/a", "trainer.steps=6"]), pm)
    ramp = [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert rates.dense == pytest.approx([0.004 * f for f in ramp]) and rates.sparse == pytest.approx([0.04 * f for f in ramp])
    train(load_config(None, [*common, f"trainer.output_dir={tmp_path}/b", "trainer.steps=2"]), pm)
    train(load_config(None, [*common, f"trainer.output_dir={tmp_path}/b", "trainer.steps=6", "trainer.resume=true"]), pm)
    assert rates.dense[6:] == rates.dense[:6] and losses(tmp_path / "a") == losses(tmp_path / "b")


def test_no_warmup_leaves_the_losses_bitwise_unchanged(pm, tiny_overrides, tmp_path):
    # warmup_steps=1 sets every step's rate to the full one: the schedule's code runs, the numbers must not move
    train(load_config(None, [*tiny_overrides, f"trainer.output_dir={tmp_path}/off", "trainer.warmup_steps=0"]), pm)
    train(load_config(None, [*tiny_overrides, f"trainer.output_dir={tmp_path}/one", "trainer.warmup_steps=1"]), pm)
    off, one = losses(tmp_path / "off"), losses(tmp_path / "one")
    assert len(off) == 6 and off == one


def test_scheduled_garbage_collection_trains_the_same_and_resumes(pm, tiny_overrides, tmp_path):
    """``trainer.gc_every`` changes when the host collects, not what is computed: bitwise the same losses,
    the collector left enabled and unfrozen, and a checkpoint of such a run continues without it (the
    field is not part of the run's identity)."""
    import gc

    train(load_config(None, [*tiny_overrides, f"trainer.output_dir={tmp_path}/py"]), pm)
    train(load_config(None, [*tiny_overrides, f"trainer.output_dir={tmp_path}/gc", "trainer.gc_every=2",
                             "trainer.steps=3"]), pm)  # fmt: skip
    assert gc.isenabled() and gc.get_freeze_count() == 0
    train(load_config(None, [*tiny_overrides, f"trainer.output_dir={tmp_path}/gc", "trainer.steps=6"]), pm)
    assert losses(tmp_path / "py") == losses(tmp_path / "gc")
