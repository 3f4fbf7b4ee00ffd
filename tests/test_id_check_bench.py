"""benchmarks/id_check.py on the CPU: the inline tiny config, its real batches, the step time measured
by the trainer (and given on the command line)."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest

from gem_model import testing
from gem_model.config_io import load_config
from gem_model.data.loader import ShardedLoader
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components

ROOT = Path(__file__).resolve().parents[1]
TINY = [*testing.INLINE_OVERRIDES, "trainer.device=cpu"]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("id_check", ROOT / "benchmarks" / "id_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def inline_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    monkeypatch.setenv("GEM_DISABLE_PLUGIN_AUTOLOAD", "1")


def test_the_id_check_is_timed_on_the_real_batches_against_the_measured_step(tmp_path: Path, inline_plugins):
    out = tmp_path / "ids.json"
    sets = [f"--set={x}" for x in TINY]
    assert load_benchmark().main(["-c", "configs/tiny.yaml", *sets, "--batches", "2", "--from-step", "3",
                                  "--measure-steps", "3", "--skip-steps", "1", "--out", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["meta"]["trainer_prefetch"] == 2 and "prefetch thread" in data["meta"]["where"]
    # the batches are those the trainer's loader builds for these data steps
    config = load_config(ROOT / "configs" / "tiny.yaml", TINY)
    c = resolve_components(config, GemPluginManager())
    loader = ShardedLoader(c.source, c.balancer, global_batch_size=config.data.global_batch_size)
    for row, step in zip(data["batches"], (3, 4), strict=True):
        batch = loader.batch_at(step)
        assert row["data_step"] == step and row["samples"] == batch.batch_size == 16
        assert row["ids"] == batch.sequence.values().numel() + batch.pooled.values().numel()
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("build_ms", "id_check_ms", "validate_ms"))
    assert data["step_ms_from"] == "median of trainer steps 2..3" and data["step_ms"] > 0
    mean_check = statistics.fmean(r["id_check_ms"] for r in data["batches"])
    assert data["id_check_share"] == pytest.approx(mean_check / data["step_ms"], rel=1e-12)
    assert data["within_budget"] == (max(r["id_check_ms"] for r in data["batches"]) / data["step_ms"] <= 0.02)


def test_a_given_step_time_and_a_check_inside_the_step(tmp_path: Path, inline_plugins):
    out = tmp_path / "ids.json"
    sets = [f"--set={x}" for x in [*TINY, "trainer.prefetch=0"]]
    assert load_benchmark().main(["-c", "configs/tiny.yaml", *sets, "--batches", "1", "--step-ms", "1e6",
                                  "--world-size", "2", "--rank", "1", "--out", str(out)]) == 0  # fmt: skip
    data = json.loads(out.read_text())
    assert data["step_ms"] == 1e6 and data["step_ms_from"] == "given" and data["within_budget"]
    assert data["meta"]["where"] == "inside the step (trainer.prefetch=0)"
    assert data["batches"][0]["samples"] == 8  # rank 1's half of the global batch of 16
