"""benchmarks/ab_report.py, what e2e_ab.py's orchestrator prints and writes from its worker's rows: here the
energy a step of each variant whose power was sampled."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_report_gives_each_sampled_variant_its_energy_a_step(monkeypatch, capsys):
    """Mean power x mean step time, for the timed steps (in the summary) and the steady rounds (in the
    steady record), printed beside the power; a variant without samples gets none."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import ab_report

    power = {"samples": 4, "watts_median": 690.0, "watts_mean": 600.0, "limit_watts": 700.0, "sm_mhz_median": 1650.0,
             "sm_mhz_min": 1600.0, "sm_mhz_max": 1700.0, "power_capped_share": 1.0}  # fmt: skip
    row = {"name": "A", "switches": ["base"], "wall_ms": [100.0, 300.0], "device_ms": [99.0, 298.0],
           "tokens": [10, 30], "flops": [1e9, 3e9], "flops_nvidia": [1e9, 3e9], "gc_ms": [0.0, 0.0],
           "losses": [1.0, 0.9], "peak_gib": 1.0, "paired": None, "power": power}  # fmt: skip
    unsampled = {**row, "name": "B", "power": None}
    ab_report.paired([row, unsampled])
    summary = [ab_report.summarize(r, 1e12) for r in (row, unsampled)]
    assert summary[0]["joules_per_step"] == pytest.approx(600.0 * 0.2)  # 600 W over the mean 200 ms
    assert summary[1]["joules_per_step"] is None
    steady = {"A": {"steps": 2, "rounds_wall_ms": [180.0, 220.0], "rounds_device_ms": [179.0, 219.0],
                    "wall_ms_per_step": 200.0, "device_ms_per_step": 199.0, "power": power},
              "B": {"steps": 2, "rounds_wall_ms": [200.0, 200.0], "rounds_device_ms": [199.0, 199.0],
                    "wall_ms_per_step": 200.0, "device_ms_per_step": 199.0, "power": None}}  # fmt: skip
    ab_report.steady_energy(steady)
    assert steady["A"]["joules_per_step"] == pytest.approx(120.0) and "joules_per_step" not in steady["B"]
    ab_report.print_table(summary)
    ab_report.print_steady(steady)
    printed = capsys.readouterr().out
    assert "A during its timed steps: 690 W of 700" in printed and "120.0 J a step" in printed
    assert "steady A during its rounds: 690 W of 700, SM clock 1650 MHz (1600-1700), power cap in 100 % of 4 samples, 120.0 J a step" in printed
    assert "B during its timed steps: not sampled" in printed
