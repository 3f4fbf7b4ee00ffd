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


@pytest.mark.parametrize("case", ["norm_sums_case", "norm_rows_sums_case"])
def test_the_norm_cases_sum_the_gradient_the_pass_writes(bench, case: str) -> None:
    torch.manual_seed(6)
    args = argparse.Namespace(rows=37, dim=40, device="cpu", sum_tiles=[1, 2])
    fns, errors = getattr(bench, case)(args)  # raises if a variant's gradient differs from the plain pass's
    assert set(fns) == {"separate", "in_pass_1", "in_pass_2"} and set(errors) == set(fns)
    assert all(0 <= e < 1e-5 for e in errors.values()), errors
    dx, sums = fns["in_pass_2"]()
    torch.testing.assert_close(sums, dx.double().sum(0).float(), rtol=1e-5, atol=1e-5)


def test_without_a_gpu_it_says_so(bench, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["reduction_passes.py"])
    assert bench.main() == 1
    assert "no GPU here" in capsys.readouterr().err
