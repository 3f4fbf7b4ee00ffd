"""The ``comm_report`` callback: per-step measurements into the summary and a report section."""

from __future__ import annotations

import gem_comm.plugin
from gem_comm.measure import CommMeter, CommReport, all_gather_bytes, ring_all_reduce_bytes, scatter_bytes
from gem_comm.overlap import OverlapComm
from gem_model import testing
from gem_model.distributed import DistEnv


def test_byte_formulas():
    assert ring_all_reduce_bytes(400, 4) == 600 and ring_all_reduce_bytes(400, 1) == 0
    assert scatter_bytes(400, 4) == 300 and all_gather_bytes(100, 4) == 300


def test_meter_totals():
    meter = CommMeter()
    meter.record("dense.all_reduce", 10, 0.5)
    meter.record("dense.all_reduce", 6)
    assert meter.totals() == {"dense.all_reduce.bytes": 16.0, "dense.all_reduce.calls": 2.0, "dense.all_reduce.seconds": 0.5}


def test_report_in_a_tiny_run(tmp_path, capsys):
    run = testing.tiny_run(
        "comm.strategy=quantized", "callbacks=[{name: comm_report}]", output_dir=tmp_path, steps=2, plugins=[gem_comm.plugin]
    )
    comm = run.summary.extra["comm"]
    # one process: no DDP, so no collective ran and nothing was measured
    assert comm == {"strategy": "quantized", "steps": 2, "per_step": {}}
    out = capsys.readouterr().out
    assert "communication" in out and "none (this strategy records none)" in out


def test_per_step_differences_of_the_strategy_totals(tmp_path):
    ctx = testing.fake_run_context(output_dir=tmp_path)
    ctx.comm = OverlapComm()
    ctx.comm.setup(DistEnv(0, 1, 0, ctx.device, None))
    report = CommReport()
    for nbytes in (100, 300):  # what the strategy's hooks record inside each step
        wrapper = report.gem_train_step(ctx, 0)
        next(wrapper)
        ctx.comm.meter.record("dense.all_reduce", nbytes, 0.25)
        try:
            wrapper.send("the step's result")
        except StopIteration as stop:
            assert stop.value == "the step's result"
    assert report.means() == {"dense.all_reduce.bytes": 200.0, "dense.all_reduce.calls": 1.0, "dense.all_reduce.seconds": 0.25}
    rows = dict(report.gem_report_sections(ctx, None)[0].rows)
    assert rows["strategy"] == "overlap" and rows["dense.all_reduce.bytes"] == "200 B/step"
