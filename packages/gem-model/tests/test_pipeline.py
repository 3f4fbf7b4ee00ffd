"""The train pipeline registry: ``sequential`` by default, stages in order, guard and clipping in the core."""

from __future__ import annotations

import math
from typing import ClassVar

import pytest
import torch

from gem_model import hookimpl
from gem_model.config_io import load_config
from gem_model.errors import NonFiniteLossError, UnknownNameError
from gem_model.lifecycle import TrainPipeline
from gem_model.train.pipeline import SequentialPipeline
from gem_model.trainer import train


class Staged(SequentialPipeline):
    """``sequential`` that records its stages, the dense gradient norm it steps with, and can poison the loss."""

    name: ClassVar[str] = "inline_staged"
    log: ClassVar[list[str]] = []
    norms: ClassVar[list[float]] = []
    poison_at: ClassVar[int | None] = None

    def next_batch(self, step):
        self.log.append(f"batch {step}")
        self._step = step
        return super().next_batch(step)

    def forward_and_loss(self, batch):
        self.log.append("forward")
        out = super().forward_and_loss(batch)
        if self._step == self.poison_at:
            out = out._replace(task_loss_sum=out.task_loss_sum * float("nan"))
        return out

    def backward(self, loss):
        self.log.append("backward")
        super().backward(loss)

    def optimizer_step(self):
        grads = [p.grad for g in self.optimizers.dense.param_groups for p in g["params"] if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        self.log.append("step")
        super().optimizer_step()


class StagedPlugin:
    @hookimpl
    def gem_register_train_pipelines(self):
        return [Staged]


@pytest.fixture(autouse=True)
def _fresh():
    Staged.log, Staged.norms, Staged.poison_at = [], [], None


def test_sequential_is_the_default_and_registered_by_the_core(pm):
    assert load_config(None, []).trainer.pipeline.name == "sequential"
    entry = pm.train_pipelines.get("sequential")
    assert entry.cls is SequentialPipeline and entry.provider.distribution == "gem-model"
    assert issubclass(entry.cls, TrainPipeline)


def test_a_registered_pipeline_runs_the_stages_in_order(pm, tiny_overrides):
    pm.register(StagedPlugin(), name="staged")
    train(load_config(None, [*tiny_overrides, "trainer.steps=2", "trainer.pipeline=inline_staged"]), pm)
    assert Staged.log == ["batch 0", "forward", "backward", "step", "batch 1", "forward", "backward", "step"]


def test_a_pipeline_trains_exactly_like_sequential_when_it_only_calls_its_stages(pm, tiny_overrides, tmp_path):
    pm.register(StagedPlugin(), name="staged")
    a = train(load_config(None, [*tiny_overrides, f"trainer.output_dir={tmp_path}/a"]), pm)
    b = train(load_config(None, [*tiny_overrides, f"trainer.output_dir={tmp_path}/b", "trainer.pipeline=inline_staged"]), pm)
    assert (a.first_loss, a.last_loss) == (b.first_loss, b.last_loss)


@pytest.mark.parametrize("check", ["before_backward", "before_tables"])
def test_the_non_finite_guard_stays_in_the_core(pm, tiny_overrides, check):
    pm.register(StagedPlugin(), name="staged")
    Staged.poison_at = 1
    overrides = [*tiny_overrides, "trainer.steps=3", "trainer.pipeline=inline_staged", f"trainer.loss_check={check}"]
    with pytest.raises(NonFiniteLossError, match=r"step 2 \(rank 0\): the loss is nan"):
        train(load_config(None, overrides), pm)
    # before backward: no backward of step 1; at the tables (trainer.loss_check): its backward stopped
    # at the tables' gate, and no optimizer step
    halted = ["forward"] if check == "before_backward" else ["forward", "backward"]
    assert Staged.log == ["batch 0", "forward", "backward", "step", "batch 1", *halted]


def test_gradient_clipping_stays_in_the_core(pm, tiny_overrides):
    pm.register(StagedPlugin(), name="staged")
    train(load_config(None, [*tiny_overrides, "trainer.steps=3", "trainer.pipeline=inline_staged", "trainer.grad_clip=0.01"]), pm)
    assert len(Staged.norms) == 3 and all(n <= 0.01 * (1 + 1e-5) for n in Staged.norms)
    assert all(math.isfinite(n) and n > 0 for n in Staged.norms)


def test_unknown_pipeline_names_the_config_path(pm, tiny_overrides):
    with pytest.raises(UnknownNameError, match=r"trainer.pipeline: unknown train pipeline 'pipedream'"):
        train(load_config(None, [*tiny_overrides, "trainer.pipeline=pipedream"]), pm)
