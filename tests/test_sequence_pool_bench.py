"""``benchmarks/sequence_pool.py`` on the CPU (Triton's interpreter): its float64 check passes for both
paths on a small batch, a wrong kernel fails it, and without a GPU the timing run says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark

SMALL = ["sequence_pool.py", "--device", "cpu", "--batch", "4", "--max-len", "16", "--dim", "32"]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return load_benchmark(monkeypatch, "sequence_pool.py")


def test_the_check_passes_on_the_cpu(bench, monkeypatch, capsys) -> None:
    monkeypatch.setattr("sys.argv", SMALL)
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "| triton |" in out and "errors checked" in out


def test_a_wrong_kernel_fails_the_check(bench, monkeypatch) -> None:
    real = bench.sequence_pool_triton

    def halved_mean(*args, **kwargs):
        hist, last, mean = real(*args, **kwargs)
        return hist, last, mean * 0.5

    monkeypatch.setattr(bench, "sequence_pool_triton", halved_mean)
    monkeypatch.setattr("sys.argv", SMALL)
    with pytest.raises(SystemExit, match="triton: errors against float64"):
        bench.main()


def test_without_a_gpu_it_says_so(bench, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["sequence_pool.py"])
    assert bench.main() == 1
    assert "no GPU here" in capsys.readouterr().err
