"""``benchmarks/reduction_passes.py``'s cases on the CPU (Triton's interpreter): each variant computes what
its float64 reference says, so the GPU run's check has teeth, and without a GPU the script says so."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return load_benchmark(monkeypatch, "reduction_passes.py")


@pytest.mark.parametrize("case", ["bias_case", "unit_rows_case"])
def test_cases_agree_with_float64(bench, case: str) -> None:
    torch.manual_seed(5)
    args = argparse.Namespace(rows=70, dim=40, negatives=12, device="cpu")
    fns, errors = getattr(bench, case)(args)
    assert set(fns) == {"torch", "triton"} and set(errors) == {"torch", "triton"}
    assert all(0 <= e < 1e-2 for e in errors.values()), errors
    torch_out, triton_out = fns["torch"](), fns["triton"]()
    if case == "bias_case":
        torch.testing.assert_close(triton_out, torch_out, rtol=1e-5, atol=1e-5)
    else:
        for got, want in zip(triton_out, torch_out, strict=True):
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-6)


def test_without_a_gpu_it_says_so(bench, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["reduction_passes.py"])
    assert bench.main() == 1
    assert "no GPU here" in capsys.readouterr().err
