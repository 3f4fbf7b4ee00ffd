"""``trainer.non_finite=skip`` leaves the parameters unchanged and halts after K skips in a row;
loss spikes of ``trainer.loss_spike_factor`` x the running median warn, in the log and in metrics."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from gem_model import testing
from gem_model.api import hookimpl
from gem_model.errors import NonFiniteLossError
from gem_model.train.spikes import LossSpikes


class Snapshots:
    """After every step: all parameters (dense and tables) and the dense optimizer's step counts."""

    def __init__(self) -> None:
        self.after: dict[int, torch.Tensor] = {}

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        result = yield
        params = [p.detach().flatten() for p in run.model.parameters()]
        steps = [s["step"].reshape(1).float() for s in run.optimizers.dense.state.values() if "step" in s]
        self.after[step + 1] = torch.cat(params + steps).clone()  # counted as the metrics count
        return result


def records(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_skip_leaves_parameters_and_optimizer_state_unchanged_and_training_goes_on(tmp_path, caplog):
    snap = Snapshots()
    poison = ["kernels.jagged_attention=poison", "kernels.jagged_attention.options.nan_from_call=3",
              "kernels.jagged_attention.options.nan_calls=2", "trainer.non_finite=skip"]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="gem_model.train"):
        run = testing.tiny_run(*poison, output_dir=tmp_path, steps=6, plugins=[snap])
    assert run.summary.steps == 6
    # steps 3 and 4 (one attention call each) made a NaN loss: nothing of theirs was applied
    assert torch.equal(snap.after[3], snap.after[2]) and torch.equal(snap.after[4], snap.after[2])
    assert not torch.equal(snap.after[5], snap.after[4]) and torch.isfinite(snap.after[6]).all()
    lines = records(tmp_path)
    skips = [r for r in lines if r.get("event") == "non_finite_skip"]
    assert [(r["step"], r["in_a_row"], r["non_finite_loss"]) for r in skips] == [(3, 1, "nan"), (4, 2, "nan")]
    assert [r["step"] for r in lines if "step_loss" in r] == [1, 2, 5, 6]
    assert sum("event=non_finite_skip" in m and "step=3" in m for m in caplog.messages) == 1


def test_skip_halts_at_the_kth_non_finite_step_in_a_row(tmp_path):
    poison = ["kernels.jagged_attention=poison", "kernels.jagged_attention.options.nan_from_call=3",
              "trainer.non_finite=skip", "trainer.non_finite_max_skips=3"]  # fmt: skip
    with pytest.raises(NonFiniteLossError) as info:
        testing.tiny_run(*poison, output_dir=tmp_path, steps=10)
    message = str(info.value)
    assert message.startswith("step 5 (rank 0): the loss is nan")  # steps 3, 4 skipped; 5 is the third
    assert "skipped the updates of the 2 step(s) before it in a row; this is trainer.non_finite_max_skips=3" in message
    assert [r["step"] for r in records(tmp_path) if r.get("event") == "non_finite_skip"] == [3, 4]


def test_halt_is_the_default_and_applies_no_update(tmp_path):
    snap = Snapshots()
    with pytest.raises(NonFiniteLossError, match=r"^step 3 \(rank 0\): the loss is nan"):
        testing.tiny_run("kernels.jagged_attention=poison", "kernels.jagged_attention.options.nan_from_call=3",
                         output_dir=tmp_path, steps=6, plugins=[snap])  # fmt: skip
    assert sorted(snap.after) == [1, 2]  # step 3 raised before its update; no later step ran


class Explode:
    """Before step ``at`` (from 1), multiply the task head's weights by 30: a real, finite loss spike."""

    def __init__(self, at: int):
        self.at = at

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        if step + 1 == self.at:
            with torch.no_grad():
                for name, p in run.model.named_parameters():
                    if "head" in name:
                        p.mul_(30.0)
        return (yield)


def test_a_loss_spike_warns_with_its_step_in_the_log_and_in_the_metrics(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="gem_model.train"):
        run = testing.tiny_run("data.global_batch_size=8", output_dir=tmp_path, steps=8, plugins=[Explode(at=7)])
    spikes = [r for r in records(tmp_path) if r.get("event") == "loss_spike"]
    assert spikes and spikes[0]["step"] == 7, spikes  # none before the explosion
    by_step = {r["step"]: r["step_loss"] for r in records(tmp_path) if "step_loss" in r}
    first = spikes[0]
    assert first["spike_loss"] == by_step[7] and first["factor"] == 10.0 and first["window"] == 20
    median = sorted(run.losses[:6])[2:4]  # the running median of steps 1..6: the mean of the middle two
    assert first["running_median"] == pytest.approx(sum(median) / 2, rel=1e-12)
    assert first["ratio"] >= 10.0
    warned = [r.gem_event for r in caplog.records if hasattr(r, "gem_event")]
    assert warned == spikes  # the log and the metrics file carry the same records


def test_the_spike_threshold_is_configurable_and_can_be_switched_off(tmp_path):
    testing.tiny_run("data.global_batch_size=8", "trainer.loss_spike_factor=null", output_dir=tmp_path / "off",
                     steps=8, plugins=[Explode(at=7)])  # fmt: skip
    assert not [r for r in records(tmp_path / "off") if "event" in r]
    detector = LossSpikes(factor=2.0, window=3)
    assert [detector.observe(s, x) for s, x in enumerate([1.0, 1.2, 0.9], start=1)] == [None, None, None]
    spike = detector.observe(4, 2.0)  # 2.0 >= 2 x median(1.0, 1.2, 0.9)
    assert spike is not None and spike.step == 4 and spike.running_median == 1.0
    assert detector.observe(5, 2.3) is None  # the window is now (1.2, 0.9, 2.0): median 1.2, 2.4 needed
