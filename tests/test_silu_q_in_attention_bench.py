"""benchmarks/silu_q_in_attention.py on the CPU: its check passes when both variants give the same output
and gradients, stops the benchmark when the attention forward's silu of the queries is off, and leaves the
shipped flag as it found it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark


def test_the_smoke_run_checks_both_variants_and_restores_the_flag(monkeypatch, capsys):
    import gem_kernels.hstu_gap_triton as gap

    shipped = gap.SILU_Q_IN_ATTENTION
    monkeypatch.setattr(sys, "argv", ["silu_q_in_attention.py", "--smoke", "--seed", "3"])
    assert load_benchmark(monkeypatch, "silu_q_in_attention.py").main() == 0
    assert "the same output and gradients bit for bit" in capsys.readouterr().out
    assert gap.SILU_Q_IN_ATTENTION is shipped


def test_a_wrong_silu_of_the_queries_stops_the_benchmark(monkeypatch):
    import gem_kernels.hstu_gap_triton as gap

    real = gap.query_major

    def silu_q_off(q, *args, silu_q_out=None, **kwargs):  # the kept silu of the queries 1 % off: the backward sees it
        out = real(q, *args, silu_q_out=silu_q_out, **kwargs)
        if silu_q_out is not None:
            silu_q_out.mul_(1.01)
        return out

    monkeypatch.setattr(gap, "query_major", silu_q_off)
    bench = load_benchmark(monkeypatch, "silu_q_in_attention.py")
    monkeypatch.setattr(sys, "argv", ["silu_q_in_attention.py", "--smoke"])
    with pytest.raises(SystemExit, match="differs between the variants"):
        bench.main()
