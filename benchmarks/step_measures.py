"""What ``benchmarks/e2e_ab.py`` measures around each training step besides its wall time: the device's
work from CUDA events (:class:`EventPipeline`) and the host's pauses in Python's garbage collector
(:class:`GcPauses`)."""

from __future__ import annotations

import gc
import time

import torch


class GcPauses:
    """Milliseconds the host spent in Python's cyclic collector (``gc.callbacks``), summed."""

    def __init__(self) -> None:
        self.total_ms = 0.0
        self._t0 = 0.0
        gc.callbacks.append(self._hook)

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.total_ms += 1e3 * (time.perf_counter() - self._t0)

    def close(self) -> None:
        gc.callbacks.remove(self._hook)


class EventPipeline:
    """Wraps the run's train pipeline to record CUDA events around the forward (to the loss) and
    around backward-and-update: per step ``[fwd start, fwd end, bwd start, update end]``."""

    def __init__(self, pipeline: object, device: torch.device):
        self.inner, self.cuda = pipeline, device.type == "cuda"
        self.steps: list[list[object]] = []

    def __getattr__(self, name: str) -> object:  # next_batch, setup, ...: the wrapped pipeline's
        return getattr(self.inner, name)

    def _mark(self, new_step: bool = False) -> None:
        if new_step:
            self.steps.append([])
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.steps[-1].append(e)
        else:
            self.steps[-1].append(time.perf_counter())

    def forward_and_loss(self, batch: object) -> object:
        self._mark(new_step=True)
        out = self.inner.forward_and_loss(batch)  # type: ignore[attr-defined]
        self._mark()
        return out

    def backward(self, loss: torch.Tensor) -> None:
        self._mark()
        self.inner.backward(loss)  # type: ignore[attr-defined]

    def optimizer_step(self) -> None:
        self.inner.optimizer_step()  # type: ignore[attr-defined]
        self._mark()

    def take(self) -> list[float]:
        """Device ms (forward span + backward-and-update span) of every step recorded since the last
        call; the device must have finished them."""
        out = []
        for a, b, c, d in self.steps:
            if self.cuda:
                out.append(a.elapsed_time(b) + c.elapsed_time(d))  # type: ignore[attr-defined]
            else:
                out.append(1e3 * ((b - a) + (d - c)))  # type: ignore[operator]
        self.steps.clear()
        return out
