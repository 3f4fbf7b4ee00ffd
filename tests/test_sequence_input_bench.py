"""``benchmarks/sequence_input.py`` on the CPU (Triton's interpreter): its float64 check passes for both
paths on a small batch, a wrong kernel fails it, and without a GPU the timing run says so."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark

SMALL = ["sequence_input.py", "--device", "cpu", "--batch", "4", "--max-len", "16", "--dim", "32"]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return load_benchmark(monkeypatch, "sequence_input.py")


@pytest.mark.parametrize("scale", ["1.0", "2.5"])
def test_the_check_passes_on_the_cpu(bench, monkeypatch, capsys, scale) -> None:
    monkeypatch.setattr("sys.argv", [*SMALL, "--scale", scale])
    assert bench.main() == 0
    out = capsys.readouterr().out
    assert "| torch |" in out and "| triton |" in out and "errors checked" in out


def test_the_block_flags_set_the_kernel(bench, monkeypatch, capsys) -> None:
    for name in bench.BLOCKS:  # restored after the test: main sets the kernel module's constants
        monkeypatch.setattr(bench.kernel_module, name, getattr(bench.kernel_module, name))
    flags = ["--chunk", "4", "--pos-block", "4", "--col-block", "16", "--sequences", "4"]
    monkeypatch.setattr("sys.argv", [*SMALL, *flags])
    assert bench.main() == 0
    assert "{'CHUNK': 4, 'POS_BLOCK': 4, 'COL_BLOCK': 16, 'SEQUENCES': 4}" in capsys.readouterr().out
    assert bench.kernel_module.POS_BLOCK == 4


@pytest.mark.parametrize("wrong", ["x", "position"])
def test_a_wrong_kernel_fails_the_check(bench, monkeypatch, wrong) -> None:
    real = bench.sequence_input_triton

    def off(*args, **kwargs):
        if wrong == "position":  # the position table's gradient doubled: x right, dposition wrong
            table = kwargs["position"]
            kwargs["position"] = table + (table - table.detach())
            return real(*args, **kwargs)
        return real(*args, **kwargs) * 0.5

    monkeypatch.setattr(bench, "sequence_input_triton", off)
    monkeypatch.setattr("sys.argv", SMALL)
    with pytest.raises(SystemExit, match="triton: errors against float64"):
        bench.main()


def test_without_a_gpu_it_says_so(bench, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("sys.argv", ["sequence_input.py"])
    assert bench.main() == 1
    assert "no GPU here" in capsys.readouterr().err
