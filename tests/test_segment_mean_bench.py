"""benchmarks/segment_mean.py on the CPU: its check passes on real power-law lengths, and fails loudly
when a method is wrong, so the GPU table is never made from a broken method."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("segment_mean_bench", ROOT / "benchmarks" / "segment_mean.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_the_smoke_run_checks_both_methods(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["segment_mean.py", "--smoke"])
    assert load_benchmark().main() == 0
    assert "gradients equal" in capsys.readouterr().out


def test_a_wrong_mean_stops_the_benchmark(monkeypatch):
    bench = load_benchmark()
    gen = torch.Generator().manual_seed(3)
    lengths = bench.lengths_of(4, 0.95, gen) % 30 + 1
    values = torch.randn(int(lengths.sum()), bench.D, generator=gen).bfloat16().requires_grad_()
    grad = torch.randn(4, bench.D, generator=gen).bfloat16()
    real = bench.segment_mean
    monkeypatch.setattr(bench, "segment_mean", lambda v, n, gemm: real(v, n, gemm=gemm) * (1.02 if gemm else 1))
    with pytest.raises(SystemExit, match="gemm=True"):
        bench.check(values, lengths, grad)
