"""Device activity of profiled training steps, read from ``torch.profiler``'s trace.

Only the trace's kernel, copy and memset events count as device work. The profiler also puts its
own annotations (``ProfilerStep#N``, module names) on the device timeline; counting those as kernels
would make the device look busy while it waits. Shared by ``e2e.py``, ``e2e_ab.py`` and ``step_idle.py``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable

import torch

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def timed_ms(fn, device: torch.device | None = None) -> float:
    """``fn()``'s time in ms: between two CUDA events on a GPU (``device`` cuda, or None with CUDA there),
    by the host clock otherwise (CPU smoke runs)."""
    cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    if not cuda:
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


HOST_WORK = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation", "python_function")
"""The trace's host-side event categories: operators, CUDA API calls, annotations."""


def trace_events(prof: torch.profiler.profile) -> list[dict]:
    """Every event of the profiler's chrome trace (dicts: ``cat``, ``ts``, ``dur``, ``name``, ...)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as fh:
            return json.load(fh).get("traceEvents", [])


def device_events(prof: torch.profiler.profile | list[dict]) -> list[dict]:
    """The kernel, copy and memset events of the trace (chrome-trace dicts: ``ts``, ``dur``, ``name``);
    ``prof`` is a profiler or the events of its trace (:func:`trace_events`)."""
    events = prof if isinstance(prof, list) else trace_events(prof)
    return [e for e in events if e.get("cat") in DEVICE_WORK]


def device_idle(events: list[dict]) -> dict[str, float]:
    """Idle share over the profiled window: 1 - union of the device events / first to last activity."""
    spans = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in events)
    if not spans:
        return {}
    busy, (lo, hi) = 0.0, spans[0]
    for a, b in spans[1:]:
        if a > hi:
            busy, lo = busy + hi - lo, a
        hi = max(hi, b)
    busy += hi - lo
    window = max(b for _, b in spans) - spans[0][0]
    streams = {(e.get("pid"), e.get("tid")) for e in events}
    return {"window_ms": window / 1e3, "busy_ms": busy / 1e3, "idle_share": 1 - busy / window, "streams": len(streams)}


def top_kernels(events: list[dict], steps: int, limit: int = 20) -> list[dict]:
    """Device time per kernel name, per step, most first."""
    per: dict[str, float] = {}
    for e in events:
        per[e["name"]] = per.get(e["name"], 0.0) + e.get("dur", 0)
    ranked = sorted(per.items(), key=lambda kv: kv[1], reverse=True)[:limit]
    return [{"kernel": name, "ms_per_step": us / 1e3 / max(steps, 1)} for name, us in ranked]


GAP_CLASSES_US = (10.0, 100.0, 1000.0)
"""Bounds of :func:`gap_histogram`'s classes: under 10 us (a launch behind the previous kernel), to
100 us, to 1 ms (the host barely behind), and longer (the host synchronised or busy)."""


def gap_windows(events: list[dict]) -> list[tuple[float, float, dict, dict]]:
    """Every stretch without device work, in time order: ``(start, end, the device event that ended last
    before it, the one that starts it)``, in the trace's microseconds. ``events``: device events or a
    whole trace (only :data:`DEVICE_WORK` counts)."""
    work = sorted((e for e in events if e.get("cat") in DEVICE_WORK), key=lambda e: (e["ts"], e["ts"] + e.get("dur", 0)))
    windows: list[tuple[float, float, dict, dict]] = []
    end, last = None, None
    for e in work:
        start, stop = e["ts"], e["ts"] + e.get("dur", 0)
        if end is not None and start > end:
            windows.append((end, start, last, e))
        if end is None or stop >= end:
            end, last = stop, e
    return windows


def gap_histogram(events: list[dict], steps: int) -> dict:
    """Kernels per step and the device's idle per step split by gap length (:data:`GAP_CLASSES_US`):
    many short gaps say the step has too many kernels; a few long ones, that the host waits or lags."""
    bounds = [*GAP_CLASSES_US, float("inf")]
    idle = [0.0] * len(bounds)
    count = [0] * len(bounds)
    for lo, hi, _, _ in gap_windows(events):
        k = next(i for i, b in enumerate(bounds) if hi - lo < b)
        idle[k] += hi - lo
        count[k] += 1
    per = max(steps, 1)
    labels = ["<10us", "10-100us", "0.1-1ms", ">1ms"]
    return {
        "kernels_per_step": sum(e.get("cat") in DEVICE_WORK for e in events) / per,
        "idle_ms_per_step": {lab: idle[i] / 1e3 / per for i, lab in enumerate(labels)},
        "gaps_per_step": {lab: count[i] / per for i, lab in enumerate(labels)},
    }


def device_gaps(events: list[dict], limit: int = 15) -> list[dict]:
    """The longest stretches with no device work, each with the kernels before and after it: where the
    device waits for the host."""
    gaps = [{"ms": (hi - lo) / 1e3, "after": before["name"][:80], "before": after["name"][:80]}
            for lo, hi, before, after in gap_windows(events)]  # fmt: skip
    gaps.sort(key=lambda g: -g["ms"])
    return gaps[:limit]


def host_during_gaps(events: list[dict], limit: int = 10, depth: int = 4) -> list[dict]:
    """What the host was doing during the longest device gaps of a trace (:func:`trace_events`).

    For each gap, the host events (:data:`HOST_WORK`) that cover at least half of it, innermost first
    (``depth`` of them): a ``cudaStreamSynchronize`` or ``cudaMemcpyAsync`` under ``aten::item`` is a
    sync; an operator or annotation that spans the gap is the host work the device waited for. A gap
    that no host event covers by half is host time between operators (Python); then the host events
    that ended last inside it are given instead."""
    host = [e for e in events if e.get("cat") in HOST_WORK and e.get("dur", 0) > 0]
    out = []
    for lo, hi, before, after in sorted(gap_windows(events), key=lambda w: w[0] - w[1])[:limit]:
        width = hi - lo
        covering = [e for e in host if min(hi, e["ts"] + e["dur"]) - max(lo, e["ts"]) >= width / 2]
        covering.sort(key=lambda e: e["dur"])
        inside = sorted((e for e in host if lo <= e["ts"] + e["dur"] <= hi), key=lambda e: -(e["ts"] + e["dur"]))
        out.append({
            "ms": width / 1e3, "device_before": before["name"][:80], "device_after": after["name"][:80],
            "host_covering": [f"{e['name'][:70]} ({e['dur'] / 1e3:.3f} ms)" for e in covering[:depth]],
            "host_ended_inside": [f"{e['name'][:70]} ({e['dur'] / 1e3:.3f} ms)" for e in inside[:depth]],
        })  # fmt: skip
    return out


def _launchers(events: list[dict], times: list[tuple[float, object]]) -> dict[object, list[str]]:
    """For each ``(host time, tid)`` query, the names of the host operators open on that thread at that
    time, outermost first (one sweep over each thread's operators, which nest)."""
    ops: dict[object, list[dict]] = {}
    for e in events:
        if e.get("cat") in ("cpu_op", "user_annotation") and e.get("dur", 0) > 0:
            ops.setdefault(e.get("tid"), []).append(e)
    out: dict[object, list[str]] = {}
    for tid, thread_ops in ops.items():
        thread_ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        queries = sorted(t for t in times if t[1] == tid)
        stack: list[dict] = []
        i = 0
        for t, _ in queries:
            while i < len(thread_ops) and thread_ops[i]["ts"] <= t:
                while stack and stack[-1]["ts"] + stack[-1]["dur"] <= thread_ops[i]["ts"]:
                    stack.pop()
                stack.append(thread_ops[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1]["dur"] < t:
                stack.pop()
            out[(t, tid)] = [e["name"] for e in stack if e["ts"] + e["dur"] >= t]
    return out


def _launch_queries(events: list[dict], work: list[dict]) -> list[tuple[float, object] | None]:
    """For each device event of ``work``, the ``(host time, tid)`` of the CUDA runtime call that launched
    it (matched by the trace's correlation id), or None when the trace has no such call."""
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}  # fmt: skip
    out: list[tuple[float, object] | None] = []
    for e in work:
        launch = launches.get(e.get("args", {}).get("correlation"))
        out.append((launch["ts"], launch.get("tid")) if launch else None)
    return out


def _launcher_key(names: list[str], forward_scope: str = "outermost") -> tuple[str, str]:
    """``(innermost operator, scope)`` of a launch whose open operators are ``names`` (outermost first):
    the scope is the backward node it runs in; in the forward, the outermost operator (``outermost``) or
    the innermost one that is not an ``aten::`` operator, such as an autograd Function (``innermost``)."""
    if not names:
        return "(no host operator)", "(no host operator)"
    backward = [n for n in names if n.startswith("autograd::engine::evaluate_function:")]
    if backward:
        return names[-1], backward[-1].split(": ", 1)[-1]
    if forward_scope == "innermost":
        named = [n for n in names[:-1] if not n.startswith("aten::")]
        return names[-1], named[-1] if named else names[0]
    return names[-1], names[0]


def idle_by_launcher(events: list[dict], steps: int, limit: int = 15) -> list[dict]:
    """Device idle per step, summed by who launched the work that ended each gap: the host operator open
    at that launch (innermost), and its scope (the backward node it runs in, else its outermost
    operator). Where many short gaps share a launcher, that stretch of the step is launch-bound."""
    windows = gap_windows(events)
    queries = _launch_queries(events, [after for _, _, _, after in windows])
    open_ops = _launchers(events, [q for q in queries if q is not None])
    per: dict[tuple[str, str], list[float]] = {}
    for (lo, hi, _, _), query in zip(windows, queries, strict=True):
        key = _launcher_key(open_ops.get(query, []) if query is not None else [])
        per.setdefault(key, []).append(hi - lo)
    ranked = sorted(per.items(), key=lambda kv: -sum(kv[1]))[:limit]
    per_step = max(steps, 1)
    return [{"launcher": op[:70], "scope": scope[:70], "gaps_per_step": len(ws) / per_step,
             "idle_ms_per_step": sum(ws) / 1e3 / per_step} for (op, scope), ws in ranked]  # fmt: skip


def work_by_launcher(events: list[dict], steps: int, keep: Callable[[str], bool] = lambda _: True,
                     limit: int = 30) -> list[dict]:  # fmt: skip
    """Device time per step of the kernels whose names ``keep`` accepts, summed by the host operator that
    launched them (innermost) and its scope (the backward node, else the innermost non-``aten::``
    operator, such as an autograd Function): which part of the model a torch kernel in the top list
    belongs to, and so which fusion would remove it."""
    work = [e for e in events if e.get("cat") in DEVICE_WORK and keep(e.get("name", ""))]
    queries = _launch_queries(events, work)
    open_ops = _launchers(events, [q for q in queries if q is not None])
    per: dict[tuple[str, str], dict[str, float]] = {}
    for e, query in zip(work, queries, strict=True):
        key = _launcher_key(open_ops.get(query, []) if query is not None else [], forward_scope="innermost")
        kernels = per.setdefault(key, {})
        kernels[e["name"]] = kernels.get(e["name"], 0.0) + e.get("dur", 0)
    ranked = sorted(per.items(), key=lambda kv: -sum(kv[1].values()))[:limit]
    per_step = max(steps, 1)
    return [{"launcher": op[:70], "scope": scope[:70], "ms_per_step": sum(k.values()) / 1e3 / per_step,
             "kernels": [name[:60] for name, _ in sorted(k.items(), key=lambda kv: -kv[1])[:3]]}
            for (op, scope), k in ranked]  # fmt: skip


def print_profile(name: str, prof: dict) -> None:
    """The profile of one variant as ``benchmarks/e2e_ab.py`` records it: categories, top kernels, kernels
    per step with the idle split by gap length, and the longest gaps."""
    print(f"\nprofile of {name}: device busy {prof['busy_ms_per_step']:.1f} ms per step")
    for c, ms in sorted(prof["categories_ms_per_step"].items(), key=lambda kv: -kv[1]):
        print(f"  {c:<14} {ms:8.2f} ms  {100 * ms / prof['busy_ms_per_step']:5.1f} %")
    for k in prof["top_kernels"]:
        print(f"  {k['ms_per_step']:8.2f} ms  {k['kernel'][:110]}")
    h = prof.get("gap_histogram")
    if h:
        split = ", ".join(f"{k} {v:.2f} ms ({h['gaps_per_step'][k]:.0f})" for k, v in h["idle_ms_per_step"].items())
        print(f"  {h['kernels_per_step']:.0f} kernels per step; idle per step by gap length (gaps): {split}")
    print("  longest device gaps (ms, the kernel before -> after):")
    for g in prof.get("gaps", []):
        print(f"  {g['ms']:8.3f} ms  {g['after'][:60]} -> {g['before'][:60]}")
    launchers = prof.get("idle_by_launcher")
    if launchers:
        print("  idle per step by the host operator that launched the work after each gap (and its scope):")
        for r in launchers:
            print(f"  {r['idle_ms_per_step']:8.3f} ms {r['gaps_per_step']:6.1f} gaps  {r['launcher'][:45]:<45}  in {r['scope'][:60]}")
    work = prof.get("work_by_launcher")
    if work:
        print("  torch's own kernels (not Triton's, not GEMMs) per step by the operator that launched them (and its scope):")
        for r in work:
            print(f"  {r['ms_per_step']:8.3f} ms  {r['launcher'][:40]:<40}  in {r['scope'][:40]:<40} {', '.join(r['kernels'])[:90]}")
    hosts = prof.get("host_during_gaps")
    if hosts:
        print("  the host during the longest gaps (events covering half the gap, innermost first; else the last"
              " to end inside it):")
        for g in hosts:
            seen = g["host_covering"] or ["(none) ended inside: " + "; ".join(g["host_ended_inside"])]
            print(f"  {g['ms']:8.3f} ms  {' < '.join(seen)[:200]}")


def torch_kernel(name: str) -> bool:
    """A kernel of torch's own (ATen's elementwise, reduction, index and copy kernels, cuBLAS's gemv):
    not one of our Triton kernels (named ``_...`` or ``..._kernel`` without a namespace) and not a GEMM
    (``nvjet``, ``cutlass``, ``sm90_``): the work a fusion of ours could take over."""
    ours = "kernel" in name and "::" not in name and "<" not in name
    return not (name.startswith(("nvjet", "cutlass", "sm90_", "_")) or ours)


def profile_steps(step: Callable[[], None], steps: int) -> dict:
    """Device time per kernel category, the top kernels and where the device waited, over ``steps``
    calls of ``step`` under ``torch.profiler`` (per call)."""
    from gem_model.profiling.step_time import categorize_kernel

    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
    trace = trace_events(prof)
    events = device_events(trace)
    categories: dict[str, float] = {}
    for e in events:
        c = categorize_kernel(e["name"])
        categories[c] = categories.get(c, 0.0) + e.get("dur", 0) / 1e3 / steps
    idle = device_idle(events)
    return {"busy_ms_per_step": idle.get("busy_ms", 0.0) / steps, "categories_ms_per_step": categories,
            "top_kernels": top_kernels(events, steps, 30), "gaps": device_gaps(events),
            "gap_histogram": gap_histogram(events, steps), "host_during_gaps": host_during_gaps(trace),
            "idle_by_launcher": idle_by_launcher(trace, steps),
            "work_by_launcher": work_by_launcher(trace, steps, keep=torch_kernel)}  # fmt: skip
