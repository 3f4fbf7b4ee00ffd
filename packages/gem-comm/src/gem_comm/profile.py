"""gem-comm's section of ``gem-train profile``: the comm strategy's own measurements of the
profiled steps (:meth:`CommStrategy.measurements`, differences around each step, see
:mod:`gem_comm.measure`) beside the bytes the planner's plan implies.

Overlap is read from what the strategy times: a timed collective (``<kind>.seconds``) is one the
backward waited for, so its seconds are exposed; an untimed one ran asynchronously and its overlap
is not claimed either way.
"""

from __future__ import annotations

from gem_model.api import ProfileContext, ProfileSection, ProfileTable, Recommendation

EXPOSED_WORTH_HIDING = 0.1


def comm_measured_section(ctx: ProfileContext) -> list[ProfileSection]:
    m = ctx.measured
    if m is None:
        return []
    kinds = sorted({k.rsplit(".", 1)[0] for k in m.comm_per_step})
    step = sum(m.step_seconds) / max(len(m.step_seconds), 1)
    rows, exposed, measured_bytes = [], 0.0, 0.0
    for kind in kinds:
        nbytes = m.comm_per_step.get(f"{kind}.bytes", 0.0)
        seconds = m.comm_per_step.get(f"{kind}.seconds")
        measured_bytes += nbytes
        exposed += seconds or 0.0
        timing = "asynchronous (not timed)" if seconds is None else f"{seconds * 1e3:.3f} ms exposed"
        rows.append([kind, nbytes / 1e6, m.comm_per_step.get(f"{kind}.calls", 0.0), timing])
    planned = ctx.sections["communication"].summary.get("bytes_per_dim", {}) if "communication" in ctx.sections else {}
    share = exposed / step if step > 0 else 0.0
    notes = [] if rows else [f"comm strategy {m.comm_strategy!r} records no measurements"]
    if planned:
        notes.append(f"the plan implies {sum(planned.values()) / 1e6:.3f} MB per step in fp32; measured {measured_bytes / 1e6:.3f} MB")
    recs = []
    names = ctx.plugins.comm_strategies.names()
    if share > EXPOSED_WORTH_HIDING and m.comm_strategy != "overlap" and "overlap" in names:
        recs.append(Recommendation(
            action="comm.strategy=overlap", expected_gain=share, metric="step time",
            evidence=f"{exposed * 1e3:.2f} ms of {step * 1e3:.2f} ms per step is exposed collective time under "
            f"{m.comm_strategy}; the gain is the most overlap can hide",
        ))  # fmt: skip
    return [ProfileSection(
        name="comm_measured",
        title=f"communication measured by {m.comm_strategy} over {len(m.step_seconds)} step(s)",
        summary={"strategy": m.comm_strategy, "per_step": dict(m.comm_per_step), "exposed_seconds": exposed,
                 "exposed_share": share, "measured_bytes": measured_bytes},
        tables=[ProfileTable("per step, this rank", ["collective", "MB / step", "calls / step", "time"], rows)],
        recommendations=recs,
        notes=notes,
    )]
