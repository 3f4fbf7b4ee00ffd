"""Non-finite values: the halt names the step (as the metrics count it), the rank and the first
non-finite parameter or gradient; a checkpoint is never written from non-finite parameters."""

from __future__ import annotations

import pytest
import torch

from gem_model.api import hookimpl
from gem_model.config_io import load_config
from gem_model.errors import NonFiniteError, NonFiniteLossError, NonFiniteStateError
from gem_model.trainer import train


class Poison:
    """After step ``after`` (counted from 1), fill one dense parameter with NaN: an exploding update."""

    def __init__(self, after: int):
        self.after, self.name = after, ""

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        result = yield
        if step + 1 == self.after:
            self.name, param = next(iter(run.model.named_parameters()))
            with torch.no_grad():
                param.fill_(float("nan"))
        return result


def test_no_checkpoint_is_written_from_non_finite_parameters(pm, tiny_overrides, tmp_path):
    poison = Poison(after=4)
    pm.register(poison, name="poison")
    cfg = load_config(None, [*tiny_overrides, "trainer.steps=8", "trainer.checkpoint_every=2"])
    with pytest.raises(NonFiniteStateError) as info:
        train(cfg, pm)
    message = str(info.value)
    assert f"step 4 (rank 0): parameter {poison.name} is non-finite on rank 0" in message
    assert "the checkpoint of step 4 was not written" in message and "step_00000002" in message
    assert sorted(p.name for p in (tmp_path / "gem-tiny" / "checkpoints").iterdir()) == ["step_00000002"]
    assert isinstance(info.value, NonFiniteError)  # gem-train exits 3


def test_the_loss_halt_names_the_first_non_finite_parameter(pm, tiny_overrides):
    poison = Poison(after=2)
    pm.register(poison, name="poison")
    with pytest.raises(NonFiniteLossError) as info:
        train(load_config(None, [*tiny_overrides, "trainer.steps=5"]), pm)
    message = str(info.value)
    assert message.startswith("step 3 (rank 0): the loss is nan")  # the metrics' count: steps 1 and 2 logged
    # read at the tables (trainer.loss_check: auto): this step's gradients exist, so only parameters are named
    assert f"First non-finite parameter on this rank: parameter {poison.name}." in message
