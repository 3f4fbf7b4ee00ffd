"""benchmarks/silu_grad_out.py's check on the CPU under Triton's interpreter, at a few short histories:
the gap's two backward forms agree within the tolerance, and a tolerance of zero fails the check (the
epilogue's one rounding differs from the last pass's two)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark

ARGS = ["--device", "cpu", "--batch", "3", "--max-len", "12", "--heads", "2", "--dim", "16", "--check-only"]


def test_the_check_passes_the_epilogue_and_catches_a_difference(monkeypatch, capsys) -> None:
    bench = load_benchmark(monkeypatch, "silu_grad_out.py")
    assert bench.main([*ARGS, "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "in_attention against last_pass" in printed and "d_uvqk_bias" in printed
    assert bench.main([*ARGS, "--seed", "3", "--max-error", "0"]) == 1
