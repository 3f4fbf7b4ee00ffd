"""benchmarks/table_grad.py on the CPU: its check passes when the one buffer holds the gradient autograd
gives by feature, and stops the benchmark when it does not, so the GPU table is never made from a broken
variant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark


def test_the_smoke_run_checks_both_variants(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["table_grad.py", "--smoke"])
    assert load_benchmark(monkeypatch, "table_grad.py").main() == 0
    assert "the same lookup gradient bit for bit" in capsys.readouterr().out


def test_a_wrong_buffer_stops_the_benchmark(monkeypatch):
    bench = load_benchmark(monkeypatch, "table_grad.py")
    real = bench.table_views
    monkeypatch.setattr(bench, "table_views", lambda base, sizes: real(base, sizes, scale=2.0))
    monkeypatch.setattr(sys, "argv", ["table_grad.py", "--smoke"])
    with pytest.raises(SystemExit, match="lookup gradients differ"):
        bench.main()
