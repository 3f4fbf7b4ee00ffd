"""benchmarks/loss_curves.py on the CPU: two variants of the tiny config trained through torchrun, their
losses compared as issue 30 compares a precision scheme's with bf16's."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("loss_curves", ROOT / "benchmarks" / "loss_curves.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_variant_is_a_name_and_its_overrides():
    bench = load_benchmark()
    assert bench.parse_variant("bf16=") == ("bf16", [])
    assert bench.parse_variant("fp8=precision.scheme=fp8_rowwise,trainer.seed=3") == (
        "fp8", ["precision.scheme=fp8_rowwise", "trainer.seed=3"]
    )
    with pytest.raises(SystemExit, match="expected NAME=OVERRIDES"):
        bench.parse_variant("no_equals_sign")


@pytest.mark.multiprocess
def test_two_variants_train_on_the_same_batches_and_are_compared_with_the_first(tmp_path: Path):
    out = tmp_path / "losses.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "loss_curves.py"), "-c", str(ROOT / "configs" / "tiny.yaml"),
           "--steps", "4", "--tail", "2", "--device", "cpu", "--variant", "a=", "--variant", "b=trainer.dense_lr=0.0001",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = json.loads(out.read_text())["rows"]
    assert a["steps"] == b["steps"] == 4 and len(a["losses"]) == 4
    assert a["first_loss"] == b["first_loss"]  # the same batch and initial weights: the same first loss
    assert a["losses"][1:] != b["losses"][1:]  # a different learning rate: different updates after it
    assert a["tail_vs_reference"] == 1.0 and b["tail_vs_reference"] == pytest.approx(b["tail_mean"] / a["tail_mean"])
    assert a["tail_mean"] == pytest.approx(sum(a["losses"][-2:]) / 2)
    assert "mean last 2" in proc.stdout
