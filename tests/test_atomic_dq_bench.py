"""benchmarks/atomic_dq.py on the CPU (Triton's interpreter): its checks (the two atomic forms of dq against
the separate dq pass) pass on a tiny batch, and stop the run when a variant's gradient is off, so the GPU
timing never runs on a broken kernel."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (as gem-kernels' conftest does)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark


def test_the_atomic_forms_match_the_separate_pass(monkeypatch, capsys):
    bench = load_benchmark(monkeypatch, "atomic_dq.py")
    monkeypatch.setattr(sys, "argv", ["atomic_dq.py", "--smoke"])
    assert bench.main() == 0
    printed = capsys.readouterr().out
    for variant in ("atomic_rows", "atomic_t"):
        for grad in ("dq", "dk", "dv"):
            assert f"'{variant}_{grad}_rel_err': " in printed


def test_a_gradient_that_is_off_stops_the_run(monkeypatch):
    bench = load_benchmark(monkeypatch, "atomic_dq.py")
    backward = bench.backward

    def nudged(case, x, variant):  # the transposed form's dq off by 2 %, as a dropped tile would make it
        run = backward(case, x, variant)
        if variant != "atomic_t":
            return run
        return lambda: (run()[0] * 1.02, *run()[1:])

    monkeypatch.setattr(bench, "backward", nudged)
    monkeypatch.setattr(sys, "argv", ["atomic_dq.py", "--smoke"])
    with pytest.raises(SystemExit, match="atomic_t: dq against separate's"):
        bench.main()
