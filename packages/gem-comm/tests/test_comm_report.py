"""The ``comm_report`` callback: per-step measurements into the summary and a report section."""

from __future__ import annotations

import pytest

import gem_comm.plugin
from gem_comm.contention import compute_slowdown
from gem_comm.measure import CommMeter, CommReport, all_gather_bytes, ring_all_reduce_bytes, scatter_bytes
from gem_comm.overlap import OverlapComm
from gem_model import testing
from gem_model.distributed import DistEnv

KEYS = {"compute.alone.seconds", "compute.beside_comm.seconds", "compute.slowdown", "comm.all_reduce.alone.seconds", "comm.all_reduces"}


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


@pytest.mark.multiprocess
def test_compute_slowdown_probe_on_two_gloo_processes(spawned):
    """``slowdown_every: 2`` over 3 steps: one probe (after step 2), run by both ranks together.
    What is checked is how the numbers relate, never how large a time is."""
    ranks = spawned(2)
    counts = set()
    for r in (ranks[0]["slowdown"], ranks[1]["slowdown"]):
        assert len(r["probes"]) == 1
        (probe,) = r["probes"]
        assert set(probe) == KEYS
        assert probe["compute.slowdown"] == probe["compute.beside_comm.seconds"] / probe["compute.alone.seconds"]
        assert probe["compute.alone.seconds"] > 0 and probe["comm.all_reduce.alone.seconds"] > 0
        # enough all-reduces in flight to outlast the probe alone (so it ran beside communication)
        n = probe["comm.all_reduces"]
        assert n >= 2 and n * probe["comm.all_reduce.alone.seconds"] >= probe["compute.alone.seconds"]
        counts.add(n)
        assert r["means"] == {"probes": 1.0, **probe}
        assert r["rows"]["slowdown probe: compute.slowdown"] == f"{probe['compute.slowdown']:,.6g}"
    assert len(counts) == 1  # the ranks agreed on the number of collectives


def test_no_probe_without_a_process_group(tmp_path):
    ctx = testing.fake_run_context(output_dir=tmp_path)
    report = CommReport(CommReport.Config(slowdown_every=1))
    wrapper = report.gem_train_step(ctx, 0)
    next(wrapper)
    with pytest.raises(StopIteration):
        wrapper.send(None)
    assert report.slowdown == [] and report.slowdown_means() == {}
    with pytest.raises(ValueError, match="needs a process group"):
        compute_slowdown(device=ctx.device)
