"""benchmarks/table_lookup.py on the CPU: torchrec's fused lookup of a small table through DMP on one gloo
rank, on the tiny config's item ids, checked (finite rows within the init bounds; the same rows from even bags)
and timed beside a plain gather."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_the_lookup_is_checked_then_timed_beside_a_gather(tmp_path: Path):
    out = tmp_path / "lookup.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(ROOT / "benchmarks" / "table_lookup.py"), "-c", str(ROOT / "configs" / "tiny.yaml"), "--device", "cpu",
           "--set", "data.global_batch_size=8", "--rounds", "2", "--bags", "4", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["checks"] == {"tbe_dtype": "torch.float32", "tbe_finite_in_bounds": True, "rows_not_all_equal": True,
                              "tbe_even4_equals_tbe": True}  # fmt: skip
    assert [r["case"] for r in data["rows"]] == ["forward tbe", "forward tbe_even4", "forward gather", "fwd+bwd tbe",
                                                 "fwd+bwd tbe_even4"]  # fmt: skip
    assert all(len(r["times_ms"]) == 2 and r["median_ms"] > 0 for r in data["rows"])
    assert data["meta"]["rows_looked_up"] > 8 * 33  # histories, 32 negatives and a candidate per sample
