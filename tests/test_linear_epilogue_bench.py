"""benchmarks/linear_epilogue.py's check and variants, on the CPU under Triton's interpreter, at a K and
widths small enough for it: the check passes the kernels and stops on a broken one."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import linear_epilogue as bench


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "K", 32)
    monkeypatch.setattr(bench, "SILU_FROM", 16)
    monkeypatch.setattr(bench, "WIDTH", {"uvqk": 64, "out": 32})


def _operands(case: str, rows: int = 24) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    n = bench.WIDTH[case]
    x = torch.randn(rows, bench.K, generator=gen).bfloat16()
    w = (torch.randn(n, bench.K, generator=gen) / bench.K**0.5).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16()
    extra = torch.empty(rows, n - bench.SILU_FROM) if case == "uvqk" else torch.randn(rows, n, generator=gen)
    return x, w, b, extra.bfloat16()


@pytest.mark.parametrize("case", ["uvqk", "out"])
def test_the_check_passes_the_kernels_and_every_variant_runs(small, case: str) -> None:
    x, w, b, extra = _operands(case)
    errors = bench.check(case, x, w, b, extra, ["m128n128k64"], 1e-2)
    assert 0 <= errors["m128n128k64"] < 1e-2
    fns = bench.variants(case, x, w, b, extra, ["m128n128k64"])
    baseline = "cublas+silu_columns" if case == "uvqk" else "cublas+add"
    assert next(iter(fns)) == baseline and "cublas" in fns
    for fn in fns.values():
        fn()


def test_the_check_leaves_a_wrong_post_out_and_keeps_the_others(small, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    x, w, b, extra = _operands("uvqk")
    real = bench.linear_silu

    def broken_in_one(*args, config, **kwargs):
        pre, post = real(*args, config=config, **kwargs)
        if config == "m128n128k64w4":
            post[3, 5] += 1
        return pre, post

    monkeypatch.setattr(bench, "linear_silu", broken_in_one)
    errors = bench.check("uvqk", x, w, b, extra, ["m128n128k64", "m128n128k64w4"], 1e-2)
    assert list(errors) == ["m128n128k64"]
    assert "uvqk m128n128k64w4: post is not silu_columns of pre (largest difference" in capsys.readouterr().out


def test_the_check_leaves_a_wrong_sum_out(small, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    x, w, b, extra = _operands("out")
    monkeypatch.setattr(bench, "linear_residual", lambda x, w, b, r, config: torch.nn.functional.linear(x, w, b))
    assert bench.check("out", x, w, b, extra, ["m128n128k64"], 1e-2) == {}
    assert "out m128n128k64: error" in capsys.readouterr().out


def test_the_check_leaves_a_config_that_does_not_run_out(small, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    x, w, b, extra = _operands("out")

    def too_big(x, w, b, r, config):
        raise RuntimeError("out of resource: shared memory")

    monkeypatch.setattr(bench, "linear_residual", too_big)
    assert bench.check("out", x, w, b, extra, ["m128n128k64"], 1e-2) == {}
    assert "did not run (RuntimeError: out of resource: shared memory)" in capsys.readouterr().out
