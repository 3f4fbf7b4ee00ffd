"""Back-propagation before the loss check (``trainer.early_backward``).

The core decides whether a step's update may be applied from the global loss, read on the host: one
sync per step. With the backward launched after that read, the device ran dry at the sync and then
waited for the host to launch the loss's backward, kernel by small kernel (the next-item loss's
gathers, copies and batched GEMMs: several ms a step on the H200's big config), before the blocks'
large kernels let the host get ahead again.

So the core launches the backward *before* it reads the loss, while the device is still busy with the
forward, and reads the loss once that backward has run. What the check protects stays protected: no
update is applied before the loss is known to be finite.

* Dense gradients only fill ``.grad``: a skipped step sets them to None again (:meth:`EarlyBackward.discard`).
* Tables whose optimizer is fused into their backward (torchrec's kernels: the update happens inside
  backward and cannot be undone) are cut off the graph: the sparse arch hands the dense model leaf
  copies of its lookup outputs (:attr:`gem_model.model.embeddings.SparseArch.cut_outputs`), the first
  backward stops at them, and only after the check does :meth:`EarlyBackward.finish` carry their
  gradients into the lookups, whose backward then updates the tables. Their gradients are the ones one
  backward would have given.

A train pipeline allows it with ``early_backward = True`` (the built-in ``sequential`` does): its
``backward(loss)`` must apply no update itself.
"""

from __future__ import annotations

import torch
from torch import nn

from gem_model.context import Optimizers
from gem_model.model.embeddings import SparseArch


class EarlyBackward:
    """The model's sparse arches cut from the dense graph (when the tables' update is fused), and the two
    halves of the backward around the core's loss check."""

    def __init__(self, model: nn.Module | None, optimizers: Optimizers):
        self.optimizers = optimizers
        fused = optimizers.sparse_fused and model is not None
        self.arches = [m for m in model.modules() if isinstance(m, SparseArch)] if fused else []
        self.on = False

    def switch(self, on: bool) -> None:
        """Cut the lookups' outputs from the graph of the forwards that follow (or stop cutting them)."""
        self.on = on
        for arch in self.arches:
            arch.cut_outputs = on
            arch.cut.clear()

    def finish(self) -> None:
        """The lookups' backward, from the gradients the first backward left on their cut outputs (the
        fused tables update here)."""
        pairs = [(out, leaf.grad) for arch in self.arches for out, leaf in arch.cut if leaf.grad is not None]
        for arch in self.arches:
            arch.cut.clear()
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [grad for _, grad in pairs])

    def discard(self) -> None:
        """A skipped step: forget what the first backward computed (no table saw any of it)."""
        self.optimizers.zero_grad()
        for arch in self.arches:
            arch.cut.clear()


def device_loss(out: object, local: torch.Tensor, ranks: int, task_weight: float, next_weight: float) -> torch.Tensor:
    """The normalised loss the core back-propagates, from the reduced sums still on the device
    (``local``: task sum, next-item sum, next-item count, samples, ...), without reading them on the host:
    the same float32 divisors as the host's ``samples / ranks`` and ``max(count, 1) / ranks``."""
    task, nxt = out.task_loss_sum, out.next_item_loss_sum  # type: ignore[attr-defined]
    samples = (local[3] / ranks).to(task.dtype)
    count = (local[2].clamp(min=1.0) / ranks).to(nxt.dtype)
    return task_weight * task / samples + next_weight * (nxt / count)  # the host formula's order of operations
