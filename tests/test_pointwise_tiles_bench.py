"""benchmarks/pointwise_tiles.py on the CPU (Triton's interpreter): every kernel's shipped launch and
another candidate run, with the arguments their kernels take now, and give the same outputs; a
candidate whose outputs differ stops the run, so the GPU sweep is never timed on a broken launch."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (as gem-kernels' conftest does)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark


def test_every_kernels_launches_run_and_agree(monkeypatch, capsys):
    bench = load_benchmark(monkeypatch, "pointwise_tiles.py")
    monkeypatch.setattr(sys, "argv", ["pointwise_tiles.py", "--smoke", "--rows", "16"])
    assert bench.main() == 0
    printed = capsys.readouterr().out
    for name in bench.KERNELS:
        assert f"{name}: 2 of 2 launches match the shipped one" in printed


def test_a_candidate_with_other_outputs_stops_the_run(monkeypatch, capsys):
    bench = load_benchmark(monkeypatch, "pointwise_tiles.py")
    launch, shipped, candidates, row_bytes = bench.KERNELS["norm_bwd"]

    def off(t, *params):
        run = launch(t, *params)
        return run if params == shipped else (lambda: tuple(o * 1.5 for o in run()))

    monkeypatch.setitem(bench.KERNELS, "norm_bwd", (off, shipped, candidates, row_bytes))
    monkeypatch.setattr(sys, "argv", ["pointwise_tiles.py", "--smoke", "--rows", "16", "--kernels", "norm_bwd"])
    assert bench.main() == 1
    assert "norm_bwd: 1 of 2 launches match the shipped one" in capsys.readouterr().out
