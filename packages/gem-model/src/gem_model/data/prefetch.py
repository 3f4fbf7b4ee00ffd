"""Batches built ahead of the step that needs them, so the device never waits for the host.

:class:`PrefetchLoader` wraps a :class:`~gem_model.data.loader.ShardedLoader`. A background thread
builds the batches of the next ``depth`` steps while the current step runs: source -> balancer ->
validation (all in ``ShardedLoader.batch_at``) -> the host-side facts the step reports (samples,
tokens, FLOPs, computed from the CPU batch so that the step never reads a device tensor for them) ->
on CUDA runs, page-locked memory and an asynchronous copy to the device on a copy stream of its own.
The step's stream waits on that copy's event (a device-side wait, not a host one) before it reads the
batch. On CPU runs the thread does the CPU work alone.

:class:`SyncFeed` is the same interface without a thread (``trainer.prefetch: 0``): the batch is
built inside the step, as before prefetching existed.

The batch of a step is a pure function of the step (``ShardedLoader.batch_at``), so which thread
built it, and how far ahead, changes nothing in the numbers: a resume at step k continues exactly.
That holds for sources that draw from their own generators, seeded by the step, as a
:class:`~gem_model.components.DataSource` must (one drawing from the global RNG would take numbers
from the training thread's stream, e.g. its dropout masks). The source is called from the thread
only; :meth:`PrefetchLoader.exclusive` keeps it away while the main thread calls the source.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from gem_model.data.batch import Batch
from gem_model.data.loader import ShardedLoader


@dataclass(frozen=True)
class StepFacts:
    """What a step reports about its batch, known on the host before the batch reaches the device."""

    samples: int
    tokens: int
    flops: float = 0.0


FactsFn = Callable[[Batch], StepFacts]


def history_facts(batch: Batch) -> StepFacts:
    """Samples and history tokens, no FLOP count (the trainer passes its own, model-aware function)."""
    return StepFacts(batch.batch_size, int(batch.history_lengths().sum()))


def _kjt_tensors(kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
    weights = kjt.weights_or_none()
    return [kjt.values(), kjt.lengths(), kjt.offsets(), *([] if weights is None else [weights])]


def batch_tensors(batch: Batch) -> list[torch.Tensor]:
    """Every tensor of ``batch``, the KJTs' values, lengths, offsets and weights included."""
    return [
        *_kjt_tensors(batch.sequence),
        *_kjt_tensors(batch.pooled),
        batch.dense,
        batch.labels,
        batch.sample_ids,
        batch.timestamps,
        batch.request_times,
        *(_kjt_tensors(batch.lookup_sequence) if batch.lookup_sequence is not None else []),
    ]


@dataclass
class StagedBatch:
    """The batch of one step on the run's device, with its host-side facts."""

    step: int
    facts: StepFacts
    waited: bool
    """True when the batch was not built yet as the step asked for it (the step had to wait for it)."""
    _batch: Batch
    _copied: torch.cuda.Event | None = field(default=None, repr=False)

    def ready(self) -> Batch:
        """The batch, safe to read on the current CUDA stream (a device-side wait, no host sync)."""
        if self._copied is not None:
            stream = torch.cuda.current_stream(self._batch.dense.device)
            stream.wait_event(self._copied)
            # The tensors were allocated on the copy stream; without this the caching allocator could
            # hand their memory to the next copy while this step's kernels still read it.
            for t in batch_tensors(self._batch):
                t.record_stream(stream)
            self._copied = None
        return self._batch


def stage(
    loader: ShardedLoader, step: int, device: torch.device, facts: FactsFn, copy_stream: torch.cuda.Stream | None
) -> tuple[Batch, StepFacts, torch.cuda.Event | None]:
    """Build the batch of ``step`` on ``device``; with ``copy_stream``, copy it there from pinned memory."""
    cpu = loader.batch_at(step)
    known = facts(cpu)
    if copy_stream is None:
        return cpu.to(device, non_blocking=True), known, None
    pinned = cpu.pin_memory()
    with torch.cuda.stream(copy_stream):
        on_device = pinned.to(device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(copy_stream)
    return on_device, known, copied


class SyncFeed:
    """Builds each step's batch when the step asks for it (no thread): ``trainer.prefetch: 0``.
    ``end``: no batch of step ``end`` or later is built (``get`` raises ``IndexError``)."""

    def __init__(
        self,
        loader: ShardedLoader,
        *,
        device: torch.device | None = None,
        facts: FactsFn = history_facts,
        end: int | None = None,
    ):
        self.loader = loader
        self.device = device if device is not None else torch.device("cpu")
        self.facts = facts
        self.end = end

    @property
    def step(self) -> int:
        """The step whose batch comes next."""
        return self.loader.step

    def get(self, step: int) -> StagedBatch:
        self._check_end(step)
        batch, known, _ = stage(self.loader, step, self.device, self.facts, None)
        self.loader.step = step + 1
        return StagedBatch(step, known, True, batch)

    def __iter__(self) -> Iterator[StagedBatch]:
        return self

    def __next__(self) -> StagedBatch:
        return self.get(self.loader.step)

    def _check_end(self, step: int) -> None:
        if self.end is not None and step >= self.end:
            raise IndexError(f"step {step} is past the last step this loader builds ({self.end - 1})")

    def exclusive(self) -> contextlib.AbstractContextManager[Any]:
        """Hold while calling the data source from the main thread (no concurrent source calls)."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Nothing to stop here; :class:`PrefetchLoader` stops its thread."""

    def __enter__(self) -> SyncFeed:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class _Built:
    step: int
    batch: Batch
    facts: StepFacts
    copied: torch.cuda.Event | None


@dataclass
class _Failed:
    step: int
    error: Exception


class _Worker:
    """One thread building steps ``start, start + 1, ...`` into a queue of ``depth`` batches."""

    def __init__(self, feed: PrefetchLoader, start: int):
        self.feed = feed
        self.next_step = start  # the step of the next item the consumer takes (consumer side)
        self.queue: queue.Queue[_Built | _Failed] = queue.Queue(maxsize=feed.depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(start,), name=f"gem-prefetch-{start}", daemon=True)
        self.thread.start()

    def _run(self, step: int) -> None:
        feed = self.feed
        if feed.device.type == "cuda":
            torch.cuda.set_device(feed.device)  # the current device is per thread
        while not self.stop.is_set() and (feed.end is None or step < feed.end):
            item: _Built | _Failed
            try:
                with feed._source_lock:
                    item = _Built(step, *stage(feed.loader, step, feed.device, feed.facts, feed._copy_stream))
            except Exception as exc:  # handed to the consumer, raised when it asks for this step
                item = _Failed(step, exc)
            if not self._put(item) or isinstance(item, _Failed):
                return
            step += 1

    def _put(self, item: _Built | _Failed) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def take(self) -> tuple[_Built | _Failed, bool]:
        """The next item, and whether the consumer had to wait for it."""
        try:
            return self.queue.get_nowait(), False
        except queue.Empty:
            pass
        while True:
            try:
                return self.queue.get(timeout=0.05), True
            except queue.Empty:
                if not self.thread.is_alive() and self.queue.empty():
                    raise RuntimeError(
                        f"the prefetch thread ended without building the batch of step {self.next_step}"
                    ) from None

    def shutdown(self, timeout: float) -> None:
        self.stop.set()
        with contextlib.suppress(queue.Empty):
            while True:  # free the batches (and device memory) it holds
                self.queue.get_nowait()
        self.thread.join(timeout)
        if self.thread.is_alive():
            warnings.warn(
                f"the prefetch thread did not stop within {timeout} s (its data source is still building a "
                "batch); it is a daemon thread and ends with the process",
                RuntimeWarning,
                stacklevel=3,
            )


class PrefetchLoader(SyncFeed):
    """Builds the batches of the next ``depth`` steps in a background thread while the current one runs.

    ``get(step)`` returns the batch of ``step``; asked for the steps in order (as the trainer does), it
    finds them built. Asked for another step (a resume, a seek), it restarts the thread there. An
    exception raised while building the batch of step ``s`` is raised by ``get(s)`` (not earlier), with
    a note naming the step and the thread's traceback. ``end``: no batch of step ``end`` or later is
    built. ``close()`` (also on ``with`` exit) stops and joins the thread.
    """

    def __init__(
        self,
        loader: ShardedLoader,
        *,
        depth: int = 2,
        device: torch.device | None = None,
        facts: FactsFn = history_facts,
        end: int | None = None,
        join_timeout: float = 60.0,
    ):
        if depth < 1:
            raise ValueError(f"prefetch depth must be at least 1, got {depth} (use SyncFeed for none)")
        super().__init__(loader, device=device, facts=facts, end=end)
        self.depth = depth
        self.join_timeout = join_timeout
        self.waits = 0
        """How many batches were asked for before they were built."""
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._source_lock = threading.Lock()
        self._worker: _Worker | None = None

    @property
    def thread(self) -> threading.Thread | None:
        return None if self._worker is None else self._worker.thread

    def get(self, step: int) -> StagedBatch:
        self._check_end(step)
        worker = self._worker
        if worker is None or worker.next_step != step:
            self._stop_worker()
            worker = self._worker = _Worker(self, step)
        item, waited = worker.take()
        worker.next_step += 1
        self.waits += waited
        if isinstance(item, _Failed):
            self._stop_worker()
            item.error.add_note(f"(raised in the prefetch thread while building the batch of step {item.step})")
            raise item.error
        if item.step != step:  # the worker's queue is in step order; anything else is a bug here
            raise RuntimeError(f"the prefetch thread built step {item.step} where step {step} was expected")
        self.loader.step = step + 1
        return StagedBatch(step, item.facts, waited, item.batch, item.copied)

    def exclusive(self) -> contextlib.AbstractContextManager[Any]:
        """While held, the thread does not call the data source (sources need not be thread-safe)."""
        return self._source_lock

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._stop_worker()
        super().load_state_dict(state)

    def _stop_worker(self) -> None:
        if self._worker is not None:
            self._worker.shutdown(self.join_timeout)
            self._worker = None

    def close(self) -> None:
        self._stop_worker()


def make_feed(
    loader: ShardedLoader, *, prefetch: int, device: torch.device, facts: FactsFn, end: int | None = None
) -> SyncFeed:
    """The trainer's batch feed: :class:`SyncFeed` for ``prefetch == 0``, else a :class:`PrefetchLoader`."""
    if prefetch == 0:
        return SyncFeed(loader, device=device, facts=facts, end=end)
    return PrefetchLoader(loader, depth=prefetch, device=device, facts=facts, end=end)


__all__ = ["PrefetchLoader", "StagedBatch", "StepFacts", "SyncFeed", "batch_tensors", "make_feed", "stage"]
