"""Measurements of a strategy's collectives, and the ``comm_report`` callback that reports them.

A strategy that measures owns a :class:`CommMeter`; its hooks call :meth:`CommMeter.record` once
per collective with the exact bytes this rank sends and the collective's wall time.
:meth:`CommStrategy.measurements <gem_model.components.CommStrategy.measurements>` returns the
running totals as a flat dict of numbers:

- ``<kind>.bytes``: bytes this rank sent to other ranks, summed over the run. A kind is
  ``<what>.<collective>``, e.g. ``dense.all_reduce``, ``dense.reduce_scatter.intra``. The count is
  exact for the algorithm each collective is accounted as: a ring all-reduce of ``n`` bytes over
  ``w`` ranks sends ``2 (w-1)/w n``, a reduce-scatter or all-to-all of ``n`` input bytes sends
  ``(w-1)/w n``, an all-gather of ``n`` input bytes sends ``(w-1) n``.
- ``<kind>.calls``: how many collectives of that kind ran.
- ``<kind>.seconds``: their wall time, from launch until the result was there, for the collectives
  a hook waits for (``quantized`` with fp32 accumulation, ``hierarchical``); backward waits with
  it, so it is exposed time. Asynchronous all-reduces (``overlap``, ``quantized`` with
  ``accumulate: wire``) are not timed (no key): nothing here claims overlap it cannot see.

The ``comm_report`` callback (``callbacks: [{name: comm_report}]``) takes the difference of these
totals around every step, puts per-step means into ``summary.extra["comm"]`` and prints them in a
``communication`` report section. With ``slowdown_every: N`` it also runs
:func:`gem_comm.contention.compute_slowdown` after every N-th step (all ranks, outside the step's
timed part) and reports the probes' means as ``summary.extra["comm"]["slowdown"]``
(``compute.slowdown``: the compute probe's time beside all-reduces over its time alone).
:func:`count_all_to_all` counts the bytes of every
``all_to_all_single`` in a block: it is how the tests and the benchmark see the embedding
all-to-all, which torchrec runs itself.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from pydantic import Field

from gem_model.api import Callback, ComponentConfig, ReportSection, hookimpl


def ring_all_reduce_bytes(nbytes: int, world: int) -> int:
    return 0 if world <= 1 else 2 * (world - 1) * nbytes // world


def scatter_bytes(nbytes: int, world: int) -> int:
    """Reduce-scatter or all-to-all of ``nbytes`` of input: every chunk but this rank's own leaves."""
    return 0 if world <= 1 else (world - 1) * nbytes // world


def all_gather_bytes(nbytes: int, world: int) -> int:
    """All-gather of ``nbytes`` of input: each rank's piece reaches the ``world - 1`` others."""
    return (world - 1) * nbytes


class CommMeter:
    """Running totals of bytes, calls and seconds per kind of collective (this rank only)."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.seconds: dict[str, float] = defaultdict(float)

    def record(self, kind: str, nbytes: int, seconds: float | None = None) -> None:
        self.bytes[kind] += int(nbytes)
        self.calls[kind] += 1
        if seconds is not None:
            self.seconds[kind] += seconds

    @contextmanager
    def timed(self, kind: str, nbytes: int) -> Iterator[None]:
        """Record one collective that the block runs and waits for."""
        start = time.perf_counter()
        yield
        self.record(kind, nbytes, time.perf_counter() - start)

    def totals(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for kind in sorted(self.calls):
            out[f"{kind}.bytes"] = float(self.bytes[kind])
            out[f"{kind}.calls"] = float(self.calls[kind])
            if kind in self.seconds:
                out[f"{kind}.seconds"] = self.seconds[kind]
        return out


@contextmanager
def count_all_to_all(meter: CommMeter, kind: str = "embedding.all_to_all") -> Iterator[None]:
    """Count the floating-point payload of every ``torch.distributed.all_to_all_single`` in the block.

    torchrec runs the embedding all-to-all itself (``dist.all_to_all_single``, forward and
    backward); the id/length all-to-all of the input distribution carries integers and is left out,
    so what is counted is the embeddings and their gradients, in the dtype that went on the wire.
    """
    original = dist.all_to_all_single

    def counted(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if input.is_floating_point():
            world = dist.get_world_size(kwargs.get("group", args[2] if len(args) > 2 else None))
            meter.record(kind, scatter_bytes(input.numel() * input.element_size(), world))
        return original(output, input, *args, **kwargs)

    dist.all_to_all_single = counted  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.all_to_all_single = original  # type: ignore[assignment]


class CommReportConfig(ComponentConfig):
    slowdown_every: int = Field(
        0, ge=0, description="after every N-th step, measure the compute slowdown while all-reduces run "
        "(gem_comm.contention; every rank, outside the step's own time); 0: never",
    )
    slowdown_mb: float = Field(4.0, gt=0, description="bytes of each all-reduce of the slowdown probe, in MiB")
    slowdown_size: int = Field(256, gt=0, description="side of the probe's square matmuls")


class CommReport(Callback):
    """Per-step means of :meth:`CommStrategy.measurements` into the run summary and the report."""

    name: ClassVar[str] = "comm_report"
    Config = CommReportConfig

    def __init__(self, config: ComponentConfig | None = None):
        super().__init__(config)
        self.per_step: list[dict[str, float]] = []
        self.slowdown: list[dict[str, float]] = []

    @hookimpl(wrapper=True)
    def gem_train_step(self, run: Any, step: int) -> Any:
        before = run.comm.measurements()
        result = yield
        after = run.comm.measurements()
        self.per_step.append({k: v - before.get(k, 0.0) for k, v in after.items()})
        every = self.config.slowdown_every  # type: ignore[attr-defined]
        if every and (step + 1) % every == 0 and dist.is_initialized() and dist.get_world_size() > 1:
            self.slowdown.append(self.probe(run.device))
        return result

    def probe(self, device: torch.device) -> dict[str, float]:
        """One :func:`~gem_comm.contention.compute_slowdown` over all ranks, with this callback's sizes."""
        from gem_comm.contention import compute_slowdown

        cfg: CommReportConfig = self.config  # type: ignore[assignment]
        return compute_slowdown(None, device=device, size=cfg.slowdown_size, nbytes=int(cfg.slowdown_mb * 2**20))

    def means(self) -> dict[str, float]:
        keys = sorted({k for s in self.per_step for k in s})
        n = max(len(self.per_step), 1)
        return {k: sum(s.get(k, 0.0) for s in self.per_step) / n for k in keys}

    def slowdown_means(self) -> dict[str, float]:
        """The probes' means (empty when none ran), and ``probes``: how many ran."""
        if not self.slowdown:
            return {}
        keys = sorted({k for s in self.slowdown for k in s})
        return {"probes": float(len(self.slowdown)), **{k: sum(s[k] for s in self.slowdown) / len(self.slowdown) for k in keys}}

    @hookimpl
    def gem_run_finished(self, run: Any, summary: Any) -> None:
        summary.extra["comm"] = {"strategy": run.comm.name, "steps": len(self.per_step), "per_step": self.means()}
        if self.slowdown:
            summary.extra["comm"]["slowdown"] = self.slowdown_means()

    @hookimpl
    def gem_report_sections(self, run: Any, summary: Any) -> list[ReportSection]:
        rows = [("strategy", run.comm.name)]
        for key, value in self.means().items():
            unit = " B/step" if key.endswith(".bytes") else (" s/step" if key.endswith(".seconds") else " /step")
            rows.append((key, f"{value:,.6g}{unit}"))
        if len(rows) == 1:
            rows.append(("measurements", "none (this strategy records none)"))
        rows += [(f"slowdown probe: {k}", f"{v:,.6g}") for k, v in self.slowdown_means().items()]
        return [ReportSection("communication", rows)]
