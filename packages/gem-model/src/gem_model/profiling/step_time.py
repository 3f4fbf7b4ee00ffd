"""The step-time section: a few real training steps under ``torch.profiler``, broken down by kind.

The config trains ``warmup + steps`` steps through the ordinary trainer (its planner, comm
strategy, pipeline and kernels; nothing is checkpointed or evaluated), under the step wrapper of
:mod:`gem_model.profiling.step_probe`: the profiler after the warm-up, each measured step's wall
time, tokens, FLOPs and communication, the allocator's peak on CUDA. This module is how that time
is put in categories, and the section that reports them.

On CUDA each device kernel is put in a category by its own name (:data:`KERNEL_CATEGORIES`):
kernels launched outside any op (Triton's direct launches, the backward on autograd's device
thread) have no op to inherit one from, and an op's self device time counted them twice or not at
all (the H200 profile of 2026-12-01 showed pointwise at 57 % of a step where the kernels say ~20 %).
``idle`` on CUDA is the steps' wall time less the union of the kernels' intervals. Only kernels,
copies and memsets count (:func:`device_work`): the profiler also puts its own annotations on the
device timeline (``ProfilerStep#N``, ``DistributedDataParallel.forward``, our ``gem::attention``
ranges), and counting those spans as kernels put pointwise at 45 % of the H200 step (3rd run, whose
kernels add up to ~20 %). Copies and memsets count as pointwise. The section lists the kernels that
take the most time, so the breakdown can be checked by name.

On the CPU, attribution per profiled op of its *self* host time, so nothing is counted twice:

1. an op inside a ``gem::attention`` range (the run's attention kernel is wrapped in one) is
   ``attention``; inside ``gem::embeddings`` (forward of the embedding collections) ``embeddings``;
2. else by the op's name (:data:`CATEGORIES`, first match): ``communication`` (collectives),
   ``embeddings`` (lookups and their backward), ``attention`` (fused attention), ``loss``
   (cross entropy, logsumexp), ``gemm`` (matmuls); everything else is ``pointwise`` (elementwise,
   norms, copies, optimizer updates);
3. ``idle`` is the measured wall time of the steps less all attributed op time: host overhead and
   waiting. Only the training loop's thread counts (backward runs on it too); the prefetch
   thread's batch building overlaps the step.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch.autograd import DeviceType

from gem_model.profiling.context import MeasuredSteps, ProfileContext
from gem_model.profiling.report import ProfileSection, ProfileTable, Recommendation

ORDER = ("attention", "gemm", "pointwise", "embeddings", "loss", "communication", "idle")
MARKER = "gem::step_probe"
SCOPES = {"gem::attention": "attention", "gem::embeddings": "embeddings"}
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "gloo", "c10d", "all_reduce", "allreduce", "all_to_all", "alltoall",
                       "all_gather", "allgather", "reduce_scatter")),
    ("embeddings", ("embedding", "fbgemm", "tbe", "bag")),
    ("attention", ("attention", "attn", "sdpa", "flash")),
    ("loss", ("cross_entropy", "logsumexp", "log_softmax", "nll_loss", "binary_cross")),
    ("gemm", ("addmm", "matmul", "bmm", "::mm", "mm_", "gemm", "einsum", "linear", "scaled_mm")),
)  # fmt: skip


KERNEL_CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl", "allreduce", "all_reduce", "alltoall", "allgather", "reducescatter")),
    ("embeddings", ("embedding", "fbgemm", "tbe")),
    # gem_kernels' jagged attention: query_major_kernel (forward, dq), key_major_kernel (dk, dv)
    ("attention", ("attention", "attn", "sdpa", "flash", "fmha", "query_major_kernel", "key_major_kernel")),
    ("loss", ("cross_entropy", "logsumexp", "log_softmax", "nll_loss")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "matmul", "scaled_mm")),
)  # fmt: skip
"""Device kernels by name (CUDA): kernels launched outside any op (Triton's direct launches, the
backward on autograd's device thread) have no op to inherit a category from, so on CUDA the
breakdown names each kernel itself."""
KERNEL_NAMES: dict[str, str] = {
    # gem_kernels' Gluon attention (attention_gluon_*), whose names are too plain to match by a part
    "forward_kernel": "attention", "forward_ws_kernel": "attention", "dq_kernel": "attention",
    "dq_ws_kernel": "attention", "dkdv_kernel": "attention", "dkdv_ws_kernel": "attention",
    # the attention backward's dq from the score gradients the dk/dv pass stores (attention_stored)
    "_dq_stored_kernel": "attention",
    # gem_kernels' GEMM with its pointwise work in the epilogue (linear_epilogue_triton)
    "_linear_epilogue": "gemm",
}  # fmt: skip
"""Device kernels whose whole name gives their category, before :data:`KERNEL_CATEGORIES` is searched."""


def categorize(name: str, table: tuple[tuple[str, tuple[str, ...]], ...] = CATEGORIES) -> str:
    low = name.lower()
    for category, needles in table:
        if any(n in low for n in needles):
            return category
    return "pointwise"


def categorize_kernel(name: str) -> str:
    """The category of a device kernel, by its whole name or else a part of it."""
    return KERNEL_NAMES.get(name) or categorize(name, KERNEL_CATEGORIES)


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """Length of the union of ``(start_us, end_us)`` intervals, in seconds (streams overlap)."""
    busy, hi = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= hi:
            continue
        busy += b - max(a, hi)
        hi = b
    return busy / 1e6


DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
"""Kineto's activity types that are device work (not the profiler's annotations)."""


def device_work(events: list[Any]) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of the device events in ``events`` (``FunctionEvent``s) that are
    kernels, copies or memsets: user annotations mirrored on the device timeline are left out."""
    out = []
    for e in events:
        if e.device_type == DeviceType.CPU or getattr(e, "is_user_annotation", False):
            continue
        kind = getattr(e, "activity_type", None)
        if isinstance(kind, str) and kind not in DEVICE_WORK:
            continue
        out.append((e.name, e.time_range.start, e.time_range.end))
    return out


def top_kernels(kernels: list[tuple[str, float, float]], steps: int, limit: int = 12) -> list[list[Any]]:
    """Rows ``[name, category, ms per step, calls per step]``, the most device time first."""
    total: dict[str, float] = {}
    calls: dict[str, int] = {}
    for name, start, end in kernels:
        total[name] = total.get(name, 0.0) + (end - start)
        calls[name] = calls.get(name, 0) + 1
    ranked = sorted(total, key=lambda n: -total[n])[:limit]
    n = max(steps, 1)
    return [[name if len(name) <= 90 else name[:87] + "...", categorize_kernel(name),
             total[name] / 1e3 / n, calls[name] / n] for name in ranked]  # fmt: skip


def idle_without_profiler(warmup_seconds: list[float], busy_per_step: float) -> tuple[float, float]:
    """(an unprofiled step's wall time, its idle estimate): the faster of the last two warm-up steps
    (kernels compiled by then, no profiler's host cost) less the profiled steps' device work per step."""
    plain = min(warmup_seconds[-2:])
    return plain, max(0.0, plain - busy_per_step)


def kernel_breakdown(kernels: list[tuple[str, float, float]], wall_s: float) -> dict[str, float]:
    """Seconds per category from device kernels ``(name, start_us, end_us)``; ``idle``: the steps'
    wall time less the union of the kernels' intervals (the device waiting for the host)."""
    out = dict.fromkeys(ORDER, 0.0)
    for name, start, end in kernels:
        out[categorize_kernel(name)] += (end - start) / 1e6
    out["idle"] = max(0.0, wall_s - busy_seconds([(a, b) for _, a, b in kernels]))
    return out


class MeasuredRun(Protocol):
    """What the section reads of the steps' probe (:class:`gem_model.profiling.step_probe.StepProbe`)."""

    kernels: list[tuple[str, float, float]]
    """The measured steps' device work on CUDA (:func:`device_work`), after :meth:`breakdown`."""

    @property
    def warmup_seconds(self) -> list[float]: ...

    def breakdown(self) -> dict[str, float]: ...

    def measured(self) -> MeasuredSteps: ...


def step_time_section(ctx: ProfileContext, probe: MeasuredRun) -> ProfileSection:
    parts = probe.breakdown()
    wall = sum(parts.values())
    share = {k: (v / wall if wall else 0.0) for k, v in parts.items()}
    measured = probe.measured()
    n = len(measured.step_seconds)
    rows = [[k, parts[k] / max(n, 1) * 1e3, 100 * share[k]] for k in ORDER]
    idle_share = share["idle"]
    summary: dict[str, Any] = {"seconds": parts, "share": share, "steps": n, "step_seconds": measured.step_seconds}
    notes = ["CUDA: device time per kernel (copies and memsets as pointwise), idle = the steps' wall time less "
             "the union of the kernels' intervals; CPU: host self time per op, idle = wall time less op time"]  # fmt: skip
    profiled_ms = 1e3 * sum(measured.step_seconds) / max(n, 1)
    if measured.unprofiled_step_seconds:
        plain_ms = 1e3 * min(measured.unprofiled_step_seconds)
        summary["unprofiled_step_ms"] = plain_ms
        notes.insert(0, f"these times are under torch.profiler, whose own host cost is in them: a step took "
                     f"{profiled_ms:.1f} ms under it and {plain_ms:.1f} ms without it (a warm-up step); read the "
                     "shares, and the MFU section's figures, which come from the unprofiled steps")  # fmt: skip
    else:
        notes.insert(0, f"these times are under torch.profiler, whose own host cost is in them ({profiled_ms:.1f} ms "
                     "a step); no unprofiled step to compare with (--warmup 2 or more gives one)")  # fmt: skip
    if ctx.device.type == "cuda" and probe.warmup_seconds and n:
        # the profiler's host cost slows the host, so the device waits more under it than without it
        busy = sum(v for k, v in parts.items() if k != "idle") / n
        plain, idle_plain = idle_without_profiler(probe.warmup_seconds, busy)
        idle_share = idle_plain / plain if plain > 0 else 0.0
        summary.update(unprofiled_step_seconds=plain, idle_without_profiler=idle_plain,
                       idle_share_without_profiler=idle_share)  # fmt: skip
        notes.append(f"without the profiler a step took {1e3 * plain:.1f} ms (the faster of the last two warm-up "
                     f"steps, another batch): idle ~{1e3 * idle_plain:.1f} ms ({100 * idle_share:.1f} %) against "
                     f"{1e3 * parts['idle'] / n:.1f} ms under the profiler, whose own host cost the rest is")  # fmt: skip
    recs = []
    # compile fuses pointwise work into GPU kernels; on a CPU it pays little and costs minutes
    if share["pointwise"] > 0.2 and not ctx.config.trainer.compile and ctx.device.type == "cuda":
        recs.append(Recommendation(
            action="trainer.compile=true (fuses the blocks' pointwise work)", expected_gain=share["pointwise"] / 2,
            metric="step time", evidence=f"pointwise ops take {100 * share['pointwise']:.1f} % of the step; "
            "the gain assumes fusion halves them",
        ))  # fmt: skip
    if idle_share > 0.2:
        recs.append(Recommendation(
            action="raise the work per step (data.global_batch_size) or trainer.prefetch", expected_gain=idle_share / 2,
            metric="step time", evidence=f"{100 * idle_share:.1f} % of the measured step time no op ran "
            "(host overhead, input waits); the gain assumes half of it can be hidden",
        ))  # fmt: skip
    return ProfileSection(
        name="step_time",
        title=f"step time over {n} measured step(s) on {ctx.device.type}, under torch.profiler",
        summary=summary,
        tables=[ProfileTable("torch.profiler breakdown", ["category", "ms / step", "% of step"], rows)] + ([
            ProfileTable("device kernels with the most time", ["kernel", "category", "ms / step", "calls / step"],
                         top_kernels(probe.kernels, n))] if probe.kernels else []),
        series={"breakdown_ms_per_step": {k: parts[k] / max(n, 1) * 1e3 for k in ORDER},
                "unprofiled_step_ms": summary.get("unprofiled_step_ms")},
        recommendations=recs,
        notes=notes,
    )
