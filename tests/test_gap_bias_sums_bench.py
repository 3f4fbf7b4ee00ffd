"""benchmarks/gap_bias_sums.py on the CPU: its check passes for both placements of the ``u`` columns' bias
sums, and stops the benchmark when one placement's sums are wrong, so the GPU table is never made from a
broken variant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark


def test_the_smoke_run_checks_both_placements(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["gap_bias_sums.py", "--smoke"])
    assert load_benchmark(monkeypatch, "gap_bias_sums.py").main() == 0
    out = capsys.readouterr().out
    assert "same gradient bit for bit" in out and "in_norm_gate" in out


def test_wrong_sums_stop_the_benchmark(monkeypatch):
    bench = load_benchmark(monkeypatch, "gap_bias_sums.py")
    real = bench.silu_grad_rows

    def off_by_one_column(*args, **kwargs):
        sums = real(*args, **kwargs)
        if kwargs.get("u_summed"):
            sums[bench.HV] += 1.0  # the first v column's sum, in the norm-gate variant only
        return sums

    monkeypatch.setattr(bench, "silu_grad_rows", off_by_one_column)
    monkeypatch.setattr(sys, "argv", ["gap_bias_sums.py", "--smoke"])
    with pytest.raises(SystemExit, match="column sums off"):
        bench.main()
