"""benchmarks/profiling.py: what the host did while the device waited, read from a chrome trace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _profiling():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("profiling", ROOT / "benchmarks" / "profiling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _ev(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur}


def test_each_long_gap_names_the_host_events_that_cover_it_innermost_first():
    p = _profiling()
    trace = [
        _ev("kernel", "gemm", 0, 100),
        _ev("kernel", "silu", 150, 10),  # a 50 us gap after gemm, no host event covers it
        _ev("kernel", "fill", 1160, 5),  # a 1 ms gap after silu: the host waited in a sync
        _ev("cpu_op", "Step", 0, 2000),  # the step's annotation covers everything: listed last
        _ev("cpu_op", "aten::item", 200, 900),
        _ev("cuda_runtime", "cudaStreamSynchronize", 210, 880),
        _ev("cpu_op", "aten::add", 120, 20),  # ended inside the first gap
        _ev("cpu_op", "aten::zeros", 2500, 1),  # outside every gap
    ]
    gaps = p.host_during_gaps(trace, limit=5)
    assert [round(g["ms"], 3) for g in gaps] == [1.0, 0.05]
    sync, short = gaps
    assert (sync["device_before"], sync["device_after"]) == ("silu", "fill")
    assert [h.split(" (")[0] for h in sync["host_covering"]] == ["cudaStreamSynchronize", "aten::item", "Step"]
    assert sync["host_covering"][0].endswith("(0.880 ms)")
    assert [h.split(" (")[0] for h in short["host_covering"]] == ["Step"]
    assert [h.split(" (")[0] for h in short["host_ended_inside"]] == ["aten::add"]
    assert p.device_events(trace) == trace[:3]  # only the device's work counts as busy
