"""``sparse_dist``: torchrec's ``TrainPipelineSparseDist`` cut into the core's staged step.

torchrec's pipeline starts the embedding input distribution (the id/length all-to-all of a
batch's KJTs, ``ShardedModule.input_dist``) of batch i+1 before the forward of batch i, and the
data part of it after that forward, so it runs behind batch i's forward and backward. Its
``progress()`` runs forward, backward and the optimizer step in one call; the gem step must put
the global loss reduction, the non-finite guard (before backward: the fused table update inside
backward cannot be undone) and gradient clipping between them. So :class:`StagedSparseDist`
subclasses it and splits ``progress()`` at those points, keeping torchrec's own batch queue,
contexts, pipelined forwards and stream handling:

- :meth:`SparseDistPipeline.next_batch` (before the forward): fill the pipeline, wait for batch i,
  start the input dist of batch i+1, read batch i+2 from the feed;
- :meth:`SparseDistPipeline.forward_and_loss`: the model's forward; the sharded modules take their
  already distributed input from the pipeline context (torchrec's ``PipelinedForward``);
- :meth:`SparseDistPipeline.backward`: wait for batch i+1's splits and start its data all-to-all,
  then zero the gradients and back-propagate;
- :meth:`SparseDistPipeline.optimizer_step`: the update, then batch i leaves the queue.

A step whose update the core skipped after its forward (``trainer.non_finite: skip``) gets what
backward and the step would have done to the queue at the next ``next_batch``.

torchrec finds which batch attribute feeds each sharded module by fx-tracing the model, which the
gem model's forward does not allow (it loops over the lookups' outputs); a model that declares them
(``ShardableModel.table_inputs``) is rewritten from that declaration, with torchrec's own
``PipelinedForward`` and input-dist utilities. Only a model without it is traced by torchrec.

Batches come from the run's feed, already staged on the device (the feed's copy stream), so
torchrec's host-to-device copy stream is not used. On the CPU torchrec uses no streams at all.
The input dist changes no number, so the losses are the ``sequential`` pipeline's, bit for bit.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import count
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel, ShardedModule
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward
from torchrec.distributed.train_pipeline.tracing import ArgInfoStepFactory
from torchrec.distributed.train_pipeline.types import ArgInfo, CallArgs
from torchrec.distributed.train_pipeline.utils import _override_input_dist_forwards

from gem_model.api import StagedBatch, TrainPipeline, batch_tensors

if TYPE_CHECKING:
    from gem_model.api import Batch, Layout, Optimizers


class StagedSparseDist(TrainPipelineSparseDist):
    """``TrainPipelineSparseDist`` whose ``progress()`` runs as :meth:`before_forward`,
    :meth:`after_forward` and :meth:`after_backward`, around the caller's forward and backward.

    Its iterator yields :class:`~gem_model.data.prefetch.StagedBatch` es; the queue holds their batches.
    """

    def __init__(self, model: nn.Module, optimizer: Any, device: torch.device):
        super().__init__(model, optimizer, device, execute_all_batches=True)
        # the feed copied the batch already, on its own stream: torchrec's copy stream stays unused
        self._memcpy_stream = None
        self.staged: deque[StagedBatch] = deque()

    # --------------------------------------------------------------------------- progress(), cut

    def before_forward(self, batches: Iterator[StagedBatch]) -> StagedBatch:
        """``progress()`` up to the forward: batch i ready, batch i+1's input dist started."""
        if not self._model_attached:
            self.attach(self._model)
        self.fill_pipeline(batches)
        if not self.batches:
            raise StopIteration
        self._set_module_context(self.contexts[0])
        self._wait_for_batch()
        if len(self.batches) >= 2:
            self.start_sparse_data_dist(self.batches[1], self.contexts[1])
        self.enqueue_batch(batches)  # batch i+2 (none past the feed's end)
        return self.staged[0]

    def after_forward(self) -> None:
        """Between forward and backward: batch i+1's splits are in, its data all-to-all starts."""
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])

    def after_backward(self) -> None:
        self.sync_embeddings(self._model, self._dmp_collection_sync_interval_batches, self.contexts[0])

    def without_update(self) -> None:
        """Batch i's forward ran but the core applied no update (``trainer.non_finite: skip``): what
        backward and the step would have done to the queue, so that batch i+1 comes next."""
        self.after_forward()
        self.dequeue_batch()

    def progress(self, dataloader_iter: Iterator[Any]) -> Any:
        raise TypeError(
            "StagedSparseDist runs inside the gem step (before_forward / after_forward / after_backward); "
            "its progress() would skip the core's loss reduction, non-finite guard and clipping"
        )

    # ------------------------------------------------------------------------ torchrec overrides

    def copy_batch_to_gpu(self, dataloader_iter: Iterator[StagedBatch]) -> tuple[Batch | None, TrainPipelineContext]:
        context = self._create_context()
        staged = self._next_batch(dataloader_iter)
        if staged is None:
            return None, context
        with self._stream_context(self._data_dist_stream):  # the input dist's stream waits for the copy
            batch = staged.ready()
            inner = self._model.module if isinstance(self._model, DistributedModelParallel) else self._model
            prepare = getattr(inner, "prepare_table_inputs", None)
            if prepare is not None:  # inputs the model derives from the batch (ShardableModel.table_inputs)
                prepare(batch)
        self.staged.append(staged)
        return batch, context

    def dequeue_batch(self) -> None:
        self.staged.popleft()
        super().dequeue_batch()

    def reset(self) -> None:
        super().reset()
        self.staged.clear()

    def _wait_for_batch(self) -> None:
        """The current stream waits for the input dist's stream (torchrec's own wait wants a
        ``Multistreamable`` batch; the gem batch's tensors are recorded one by one)."""
        stream = self._data_dist_stream
        if stream is None:
            return
        current = torch.get_device_module(stream.device).current_stream()
        current.wait_stream(stream)
        for t in batch_tensors(self.batches[0]):
            t.record_stream(current)

    def _pipeline_model(
        self,
        batch: Batch | None,
        context: TrainPipelineContext,
        pipelined_forward: type[PipelinedForward] = PipelinedForward,
    ) -> None:
        inner = self._model.module if isinstance(self._model, DistributedModelParallel) else self._model
        declared = getattr(inner, "table_inputs", None)
        if declared is None:  # torchrec's own: fx-trace the model to find each sharded module's input
            super()._pipeline_model(batch, context, pipelined_forward)
            return
        modules = dict(inner.named_modules())
        self._pipelined_modules, self._original_forwards = [], []
        for fqn, attr in declared().items():
            module = modules.get(fqn)
            if not isinstance(module, ShardedModule):
                raise ValueError(
                    f"trainer.pipeline 'sparse_dist': table module {fqn!r} (fed by batch.{attr}) is "
                    f"{type(module).__name__ if module is not None else 'missing'}, not a torchrec ShardedModule"
                )
            call = CallArgs(args=[ArgInfo(steps=[ArgInfoStepFactory.get_attr(attr)])], kwargs={})
            self._original_forwards.append(module.forward)
            module.is_pipelined = True
            module.forward = pipelined_forward(fqn, call, module, context, self._data_dist_stream)  # type: ignore[method-assign]
            self._pipelined_modules.append(module)
        self.start_sparse_data_dist(batch, context)  # builds the input dists, so they can be fused
        self._original_kjt_dist_forwards = _override_input_dist_forwards(self._pipelined_modules)


class SparseDistPipeline(TrainPipeline):
    """The ``sparse_dist`` train pipeline (needs a torchrec-sharded model: ``torchrec_ddp``)."""

    name: ClassVar[str] = "sparse_dist"

    def setup(self, *, model: nn.Module, optimizers: Optimizers, feed: object, layout: Layout) -> None:
        super().setup(model=model, optimizers=optimizers, feed=feed, layout=layout)
        if not isinstance(model, DistributedModelParallel) or not any(
            isinstance(m, ShardedModule) for m in model.module.modules()
        ):
            raise ValueError(
                "trainer.pipeline 'sparse_dist' overlaps torchrec's embedding input all-to-all and needs a "
                "model whose tables torchrec sharded (parallel.planner 'torchrec_ddp'); this run's planner "
                f"made a {type(model).__name__} without torchrec ShardedModules. Use trainer.pipeline=sequential"
            )
        self.torchrec = StagedSparseDist(model, optimizers, model.device)
        self._batches: Iterator[StagedBatch] | None = None
        self._next_step: int | None = None
        self._open = False  # a batch was handed out and its optimizer_step has not run yet

    def _read(self, start: int) -> Iterator[StagedBatch]:
        """The feed's batches from ``start`` on, none at or past its ``end`` (``trainer.steps``)."""
        end = self.feed.end  # type: ignore[attr-defined]
        for step in count(start) if end is None else range(start, end):
            yield self.feed.get(step)  # type: ignore[attr-defined]

    def next_batch(self, step: int) -> StagedBatch:
        if self._batches is None or step != self._next_step:  # the first step, or a resume
            self.torchrec.reset()
            self._batches = self._read(step)
        elif self._open:  # the core skipped the last step's update after its forward
            self.torchrec.without_update()
        staged = self.torchrec.before_forward(self._batches)
        self._open = True
        if staged.step != step:
            raise RuntimeError(f"trainer.pipeline 'sparse_dist': step {step} got the batch of step {staged.step}")
        self._next_step = step + 1
        # the loader's position is the core's step, not how far the pipeline read ahead (a
        # checkpoint written after this step resumes the loader there)
        self.feed.loader.step = step + 1  # type: ignore[attr-defined]
        return staged

    def forward_and_loss(self, batch: Batch) -> object:
        self.model.train()
        return self.model(batch)

    def backward(self, loss: torch.Tensor) -> None:
        self.torchrec.after_forward()
        self.optimizers.zero_grad()
        loss.backward()
        self.torchrec.after_backward()

    def optimizer_step(self) -> None:
        self.optimizers.step()
        self.torchrec.dequeue_batch()
        self._open = False
