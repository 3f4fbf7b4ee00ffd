"""What the slowdown test runs in each process: the ``comm_report`` callback's compute-slowdown
probe after every 2nd of 3 steps (a real gloo group; the step itself is not run)."""

from __future__ import annotations

import tempfile
from typing import Any

from gem_comm.default import DefaultComm
from gem_comm.measure import CommReport
from gem_model.testing import fake_run_context


def run(rank: int, world: int) -> dict[str, Any]:
    report = CommReport(CommReport.Config(slowdown_every=2, slowdown_mb=0.25, slowdown_size=64))
    with tempfile.TemporaryDirectory() as tmp:
        ctx = fake_run_context(output_dir=tmp)
    ctx.comm = DefaultComm()
    for step in range(3):
        wrapper = report.gem_train_step(ctx, step)
        next(wrapper)
        try:
            wrapper.send(f"result {step}")
        except StopIteration as stop:
            assert stop.value == f"result {step}"
    rows = dict(report.gem_report_sections(ctx, None)[0].rows)
    return {"probes": report.slowdown, "means": report.slowdown_means(), "rows": rows}
