"""What a run reports: each step's metrics record, the end-of-run summary, and the summary with the
plugins' sections as one printed table.

The types live in the leaf module :mod:`gem_model.results`; they are re-exported here too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from gem_model.config import RunConfig
from gem_model.results import ReportSection, RunSummary, StepResult

__all__ = ["ReportSection", "RunSummary", "format_sections", "run_summary", "step_record", "summaries_printed"]

_PRINTED: ContextVar[bool] = ContextVar("gem_summaries_printed", default=True)


@contextmanager
def summaries_printed(printed: bool) -> Iterator[None]:
    """Within it, runs print their end-of-run summary only if ``printed``: ``tune`` and ``profile``
    train many short runs and report on them themselves (the summary is still returned)."""
    token = _PRINTED.set(printed)
    try:
        yield
    finally:
        _PRINTED.reset(token)


def summary_printed() -> bool:
    return _PRINTED.get()


def step_record(result: StepResult, mean_loss: float, peak_flops_all: float) -> dict[str, float]:
    """The metrics line of one step. ``peak_flops_all``: the per-GPU peak times the world size, so
    ``mfu`` is per GPU."""
    s = max(result.seconds, 1e-12)
    return {
        "step": result.step + 1,
        "loss": mean_loss,
        "step_loss": result.loss,
        "task_loss": result.task_loss,
        "next_item_loss": result.next_item_loss,
        "samples_per_s": result.samples / s,
        "tokens_per_s": result.tokens / s,
        "mfu": result.flops / s / peak_flops_all,
        "step_seconds": result.seconds,
    }


def run_summary(
    c: RunConfig, *, steps: int, first: float, last: float, wall: float, rates: dict[str, float], peak: float,
    peak_source: str, world_size: int, device: str, extra: dict[str, Any], trained: int | None = None,
) -> RunSummary:
    """The end-of-run summary; MFU per GPU (the FLOPs of all ranks over ``world_size`` peaks)."""
    return RunSummary(
        name=c.name,
        steps=steps,
        first_loss=first,
        last_loss=last,
        wall_seconds=wall,
        samples_per_s=rates["samples_per_s"],
        tokens_per_s=rates["tokens_per_s"],
        mfu=rates["flops_per_s"] / (peak * world_size),
        peak_flops=peak,
        peak_source=peak_source,
        world_size=world_size,
        device=device,
        components={
            "attention kernel": c.kernels.jagged_attention.name,
            "precision": c.precision.scheme.name,
            "activation": c.activation.policy.name,
            "planner": c.parallel.planner.name,
            "comm": c.comm.strategy.name,
            "data": f"{c.data.source.name}, global batch {c.data.global_batch_size}",
            "pipeline": c.trainer.pipeline.name,
            "callbacks": ", ".join(ref.name for ref in c.callbacks) or "none",
        },
        extra=extra,
        trained_steps=trained,
    )


def format_sections(sections: list[ReportSection]) -> str:
    width = max((len(label) for s in sections for label, _ in s.rows), default=10)
    lines: list[str] = []
    for s in sections:
        lines.append(f"== {s.title} " + "=" * max(0, 60 - len(s.title)))
        lines += [f"  {label:<{width}}  {value}" for label, value in s.rows]
    return "\n".join(lines)
