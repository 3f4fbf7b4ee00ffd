"""benchmarks/attention_loads.py on the CPU (Triton's interpreter): its checks (the attention kernels with
tensor-descriptor loads against pointer loads) pass on a tiny batch, and stop the run when the two
modes' outputs differ, so the GPU timing never runs on a broken kernel."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (as gem-kernels' conftest does)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark


def test_the_two_load_modes_give_the_same_bits(monkeypatch, capsys):
    bench = load_benchmark(monkeypatch, "attention_loads.py")
    monkeypatch.setattr(sys, "argv", ["attention_loads.py", "--smoke"])
    assert bench.main() == 0
    printed = capsys.readouterr().out
    for kernel in ("forward0", "dq0", "dkdv0", "dkdv1"):
        assert f"'fixed_{kernel}_equal': True" in printed


def test_outputs_that_differ_stop_the_run(monkeypatch):
    bench = load_benchmark(monkeypatch, "attention_loads.py")
    in_mode = bench.in_mode

    def nudged(mode, fn):  # the descriptor mode's outputs off, as a leak past a sequence would make them
        run = in_mode(mode, fn)
        return run if mode == "pointers" else (lambda: [o * 1.5 for o in bench.as_list(run())])

    monkeypatch.setattr(bench, "in_mode", nudged)
    monkeypatch.setattr(sys, "argv", ["attention_loads.py", "--smoke"])
    with pytest.raises(SystemExit, match="TMA and pointer loads differ"):
        bench.main()
