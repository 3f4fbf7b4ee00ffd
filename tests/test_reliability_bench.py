"""benchmarks/reliability_overhead.py on the CPU: the lock and the soundness check timed in an
output directory of the inline tiny config, spread over its run, against the measured step."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from gem_model import testing

ROOT = Path(__file__).resolve().parents[1]
TINY = [*testing.INLINE_OVERRIDES, "trainer.device=cpu"]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("reliability_overhead", ROOT / "benchmarks" / "reliability_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def inline_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    monkeypatch.setenv("GEM_DISABLE_PLUGIN_AUTOLOAD", "1")


def test_the_pieces_are_timed_and_spread_over_the_run(tmp_path: Path, inline_plugins):
    out = tmp_path / "rel.json"
    sets = [f"--set={x}" for x in [*TINY, "trainer.steps=40"]]
    assert load_benchmark().main(["-c", "configs/tiny.yaml", *sets, "--measure-steps", "3", "--skip-steps", "1",
                                  "--repeats", "3", "--marks", "5", "--checkpoint-every", "10", "--out", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    host, per_step = data["host_ms"], data["per_step_ms"]
    assert all(math.isfinite(v) and v > 0 for v in host.values())
    assert data["meta"]["steps"] == 40 and data["meta"]["checkpoint_every"] == 10
    assert per_step["soundness marks (1 in 10 steps)"] == pytest.approx(host["soundness_mark_ms"] / 10)
    assert per_step["lock (1 in 40 steps)"] == pytest.approx(host["lock_ms"] / 40)
    assert data["step_ms_from"] == "median of trainer steps 2..3" and data["step_ms"] > 0
    assert data["share"] == pytest.approx(sum(per_step.values()) / data["step_ms"], rel=1e-12)
    assert data["within_budget"] == (data["share"] <= 0.005)
