"""benchmarks/attention_gluon.py's check, on the CPU: the Gluon kernel does not run here (no interpreter),
so the Triton forward stands in for it, and so do two broken kernels that the check must catch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gem_kernels.attention_gluon")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from attention_gluon import Case, check, inputs_of, main, triton_dq, triton_forward


def _inputs() -> dict:
    lengths = torch.tensor([7, 0, 1, 18, 5])
    targets = torch.tensor([2, 0, 0, 3, 5])
    return inputs_of(Case(len(lengths), 2, 16, 18, 1.0), lengths, targets, seed=int(torch.randint(0, 10**6, ())),
                     device=torch.device("cpu"))


def test_the_check_passes_a_kernel_equal_to_the_triton_forward() -> None:
    x = _inputs()
    result = check(x, ["m64n64"], 1e-2, forward=lambda x, config, out: triton_forward(x, out))
    assert result["failures"] == [], result
    assert result["against_triton"]["m64n64"] == 0.0
    assert 0 < result["against_float64"]["triton"] < 1e-2  # bf16 P: not exact, not far


def test_the_check_fails_a_row_left_unwritten_and_a_wrong_scale() -> None:
    x = _inputs()

    def skips_a_row(x, config, out):
        full = triton_forward(x)
        out[1:] = full[1:]  # row 0 stays NaN

    def scaled(x, config, out):
        out.copy_(triton_forward(x) * 1.05)

    holes = check(x, ["m64n64"], 1e-2, forward=skips_a_row)
    assert any("from the Triton output" in f for f in holes["failures"]), holes
    wrong = check(x, ["m128n64"], 1e-2, forward=scaled)
    assert any("m128n64" in f and "from float64" in f for f in wrong["failures"]), wrong


def test_the_dq_check_compares_gradients_of_q() -> None:
    x = _inputs()
    good = check(x, ["m64n64"], 1e-2, forward=lambda x, config, out: triton_dq(x, out), dq=True)
    assert good["failures"] == [] and 0 < good["against_float64"]["triton"] < 2e-2, good
    # the forward's output in place of dq: caught against both references
    bad = check(x, ["m64n64"], 1e-2, forward=lambda x, config, out: out.copy_(triton_forward(x)), dq=True)
    assert len(bad["failures"]) == 2, bad


def test_unknown_names_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--cases", "edges,n9", "--configs", "m999"])
    assert "unknown case or config: n9, m999" in capsys.readouterr().err
