"""A resume point is one that trains: a checkpoint written from finite but exploded weights (a
learning-rate blow-up) is passed over once the step after it halts, and the halt names the newest
checkpoint a step trained from."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from gem_model import testing
from gem_model.api import hookimpl
from gem_model.config_io import load_config
from gem_model.errors import NonFiniteLossError
from gem_model.plugins import GemPluginManager
from gem_model.train.soundness import MARKS, Soundness, is_sound, unsound_reason
from gem_model.trainer import train


class BlowUp:
    """After step ``after`` (counted from 1), scale every dense weight by 1e30: still finite (a
    checkpoint may be written from it), but the next forward overflows."""

    def __init__(self, after: int):
        self.after = after

    @hookimpl(wrapper=True)
    def gem_train_step(self, run, step):
        result = yield
        if step + 1 == self.after:
            with torch.no_grad():
                for name, param in run.model.named_parameters():
                    if "sparse" not in name:
                        param.mul_(1e30)
        return result


def step_losses(out: Path) -> list[tuple[int, float]]:
    records = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return [(r["step"], r["step_loss"]) for r in records if "step_loss" in r]


def test_a_checkpoint_the_next_step_halts_from_is_passed_over(pm, tiny_overrides, tmp_path, capsys):
    overrides = [*tiny_overrides, "trainer.steps=6", "trainer.checkpoint_every=2", "trainer.eval_at_end=false"]
    blow_up = BlowUp(after=4)
    pm.register(blow_up, name="blow_up")
    with pytest.raises(NonFiniteLossError) as info:
        train(load_config(None, overrides), pm)
    root = tmp_path / "gem-tiny" / "checkpoints"
    message = str(info.value)
    assert message.startswith("step 5 (rank 0): the loss is")  # the step after the blow-up
    assert f"Resume point: {root / 'step_00000002'} (a step trained from it)" in message
    assert "passed over step_00000004" in message
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]  # finite: it was written
    assert is_sound(root / "step_00000002") and "halted at step 5" in unsound_reason(root / "step_00000004")

    capsys.readouterr()
    train(load_config(None, overrides), GemPluginManager(autoload=False, plugins=[testing]))  # again, no blow-up
    said = capsys.readouterr().out
    assert f"skipped checkpoint {root / 'step_00000004'}: the run from it halted at step 5" in said
    assert f"continuing from {root / 'step_00000002'} (step 2 of 6)" in said
    steps = step_losses(tmp_path / "gem-tiny")
    assert [s for s, _ in steps] == [1, 2, 3, 4, 5, 6] and all(math.isfinite(x) for _, x in steps)
    assert unsound_reason(root / "step_00000004") is None  # written again, from sound weights


def test_soundness_marks_only_what_a_finite_step_followed(tmp_path):
    root = tmp_path / "out" / "checkpoints"
    a, b, c = (root / f"step_0000000{i}" for i in (2, 4, 6))
    for path in (a, b, c):
        path.mkdir(parents=True)
    known = Soundness(writes=True)
    known.written(a)
    known.trained(3, 1.5)
    known.written(b)
    known.written(c)  # two checkpoints without a finite step between them (a skipped step, say)
    assert known.halted(7, math.nan) == [c, b]
    assert is_sound(a) and not is_sound(b) and unsound_reason(b) == unsound_reason(c)
    assert "halted at step 7 on a non-finite loss (nan)" in unsound_reason(c)
    assert set(json.loads((tmp_path / "out" / MARKS).read_text())) == {a.name, b.name, c.name}
    silent = Soundness(writes=False)  # ranks other than 0 decide alike, and write nothing
    silent.written(c)
    silent.trained(8, 1.0)
    assert silent.sound == c and not is_sound(c)
