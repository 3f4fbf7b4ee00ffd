"""``sequential``: the built-in train pipeline, each stage in turn, nothing overlapped.

forward and loss -> (the core: global loss reduction, non-finite guard, normalisation) ->
zero the gradients and backward -> (the core: clipping) -> the optimizers' step. This is exactly
the step the trainer ran before pipelines were a registry, so its losses are bit for bit the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from gem_model.lifecycle import TrainPipeline

if TYPE_CHECKING:
    import torch

    from gem_model.data.batch import Batch


class SequentialPipeline(TrainPipeline):
    name: ClassVar[str] = "sequential"

    def forward_and_loss(self, batch: Batch) -> object:
        self.model.train()
        return self.model(batch)

    def backward(self, loss: torch.Tensor) -> None:
        self.optimizers.zero_grad()
        loss.backward()

    def optimizer_step(self) -> None:
        self.optimizers.step()
