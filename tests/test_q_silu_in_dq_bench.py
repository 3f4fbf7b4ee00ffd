"""benchmarks/q_silu_in_dq.py on the CPU: its check passes for both placements of the q columns' silu gradient,
puts the shipped flag back, and stops the benchmark when the dq pass's q columns are wrong, so the GPU table is
never made from a broken variant."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark


def test_the_smoke_run_checks_both_placements(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["q_silu_in_dq.py", "--smoke"])
    bench = load_benchmark(monkeypatch, "q_silu_in_dq.py")
    shipped = bench.gap.Q_SILU_IN_DQ
    assert bench.main() == 0
    assert bench.gap.Q_SILU_IN_DQ is shipped
    assert "the same gradient outside q bit for bit" in capsys.readouterr().out


def test_a_wrong_dq_pass_stops_the_benchmark(monkeypatch):
    bench = load_benchmark(monkeypatch, "q_silu_in_dq.py")
    from gem_kernels import attention_stored

    real = attention_stored.dq_from_stored

    def doubled(*args, **kwargs):
        out = real(*args, **kwargs)
        if kwargs.get("silu") is not None:
            out.mul_(2)
        return out

    monkeypatch.setattr(attention_stored, "dq_from_stored", doubled)
    monkeypatch.setattr(sys, "argv", ["q_silu_in_dq.py", "--smoke"])
    with pytest.raises(SystemExit, match="differ past one rounding"):
        bench.main()
