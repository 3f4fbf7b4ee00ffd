"""benchmarks/next_item_kernel.py on the CPU (Triton's interpreter): its check of the triton loss against
the torch loss passes on power-law lengths, every tile candidate is checked against the shipped tiles,
and a wrong kernel stops the script, so the GPU table is never made from a broken kernel."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (as gem-kernels' conftest does)

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("next_item_kernel_bench", ROOT / "benchmarks" / "next_item_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.parametrize("tiles", [False, True], ids=["kernels", "tiles"])
def test_the_smoke_run_checks_the_kernels(monkeypatch, capsys, tiles):
    monkeypatch.setattr(sys, "argv", ["next_item_kernel.py", "--smoke", *(["--tiles"] if tiles else [])])
    load_benchmark().main()
    printed = capsys.readouterr().out
    assert "big: B 4" in printed and "mix2: B 4" in printed and "triton against torch" in printed


def test_a_wrong_kernel_stops_the_benchmark(monkeypatch):
    bench = load_benchmark()
    real = bench.TritonNextItemLoss.__call__

    def off(self, *args, **kwargs):
        loss, count = real(self, *args, **kwargs)
        return loss * 1.001, count

    monkeypatch.setattr(bench.TritonNextItemLoss, "__call__", off)
    monkeypatch.setattr(sys, "argv", ["next_item_kernel.py", "--smoke"])
    with pytest.raises(SystemExit, match="differ beyond"):
        bench.main()
