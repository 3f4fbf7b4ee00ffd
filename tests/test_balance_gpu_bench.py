"""benchmarks/balance_gpu.py on the CPU: the tiny config split over 2 simulated ranks, one timed batch."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("gem_parallel", reason="needs gem-parallel (the seq_balanced balancer)")

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("balance_gpu", ROOT / "benchmarks" / "balance_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_config_on_two_simulated_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("GEM_DISABLE_PLUGIN_AUTOLOAD", raising=False)  # seq_balanced comes from gem-parallel
    out = tmp_path / "balance.json"
    bench = load_benchmark()
    args = ["-c", str(ROOT / "configs" / "tiny.yaml"), "--device", "cpu", "--ranks", "2", "--batches", "1",
            "--out", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    data = json.loads(out.read_text())
    meta = data["meta"]
    assert (meta["ranks"], meta["global_batch_size"], meta["per_rank"], meta["batches"]) == (2, 64, 32, 1)
    assert meta["cost"]["a"] > 0 and meta["cost"]["b"] > 0  # bound to the tiny model's FLOP count
    assert set(data["balancers"]) == {"round_robin", "seq_balanced"}
    for name, r in data["balancers"].items():
        assert len(r["batches"]) == 1
        row = r["batches"][0]
        assert row["data_step"] == 2  # after the 2 warm-up batches
        assert len(row["rank_ms"]) == 2 and all(math.isfinite(x) and x > 0 for x in row["rank_ms"])
        assert r["slowest_rank_ms"] == pytest.approx(max(row["rank_ms"]))
        # every sample of the global batch on exactly one rank, 32 on each
        placed = sorted(i for rank in row["assignment"] for i in rank)
        assert placed == list(range(64)), name
        assert [len(rank) for rank in row["assignment"]] == [32, 32]
        est = row["estimated"]
        assert r["estimated_max_over_mean"] == pytest.approx(max(est) / (sum(est) / len(est)), rel=1e-9)
    rr, sb = data["balancers"]["round_robin"], data["balancers"]["seq_balanced"]
    assert rr["batches"][0]["assignment"] == [list(range(0, 64, 2)), list(range(1, 64, 2))]
    assert sb["estimated_max_over_mean"] <= rr["estimated_max_over_mean"] + 1e-12
    assert sb["estimated_max_over_mean"] == pytest.approx(1.0, abs=1e-3)  # 64 samples of lengths up to 63
    assert data["speedup_seq_balanced_over_round_robin"] == pytest.approx(rr["slowest_rank_ms"] / sb["slowest_rank_ms"])


def test_a_sample_on_two_ranks_is_refused():
    bench = load_benchmark()
    with pytest.raises(AssertionError, match=r"on no rank \[3\], on several ranks \[2\]"):
        bench.check_partition([torch.tensor([0, 2]), torch.tensor([1, 2])], [], 4, "here")
    with pytest.raises(AssertionError, match=r"outside \[0, 4\): \[4\]"):
        bench.check_partition([torch.tensor([0, 4]), torch.tensor([1, 2])], [], 4, "here")
    with pytest.raises(AssertionError, match="the ranks. batches hold 0 sample ids"):
        bench.check_partition([torch.tensor([0, 3]), torch.tensor([1, 2])], [], 4, "here")
