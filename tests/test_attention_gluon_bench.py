"""benchmarks/attention_gluon.py's check, on the CPU: the Gluon kernel does not run here (no interpreter),
so the Triton forward stands in for it, and so do two broken kernels that the check must catch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("gem_kernels.attention_gluon")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from attention_gluon import Case, check, inputs_of, main, triton_pass


def _inputs() -> dict:
    lengths = torch.tensor([7, 0, 1, 18, 5])
    targets = torch.tensor([2, 0, 0, 3, 5])
    return inputs_of(Case(len(lengths), 2, 16, 18, 1.0), lengths, targets, seed=int(torch.randint(0, 10**6, ())),
                     device=torch.device("cpu"))


def _into(out, results):
    for o, r in zip(out, results):
        o.copy_(r)


@pytest.mark.parametrize("which", ["forward", "dq", "dkdv"])
def test_the_check_passes_a_kernel_equal_to_the_triton_one(which) -> None:
    x = _inputs()
    result = check(x, which, ["m64n64"], 1e-2, run=lambda x, w, c, out: _into(out, triton_pass(x, w)))
    assert result["failures"] == [], result
    assert result["against_triton"]["m64n64"] == 0.0
    assert 0 < result["against_float64"]["triton"] < 2e-2  # bf16 P and ds: not exact, not far


def test_the_check_fails_a_row_left_unwritten_and_a_wrong_scale() -> None:
    x = _inputs()

    def skips_a_row(x, which, config, out):
        full = triton_pass(x, which)
        for o, f in zip(out, full):
            o[1:] = f[1:]  # row 0 stays NaN

    def scaled(x, which, config, out):
        _into(out, [t * 1.05 for t in triton_pass(x, which)])

    holes = check(x, "forward", ["m64n64"], 1e-2, run=skips_a_row)
    assert any("from the Triton kernel" in f for f in holes["failures"]), holes
    # the row left NaN is row 0 of sequence 0 (length 7, 2 targets); every head of it
    assert holes["worst"]["m64n64"].startswith("sequence 0 (length 7, 2 targets) row 0 head 0: inf"), holes
    wrong = check(x, "forward", ["m128n64"], 1e-2, run=scaled)
    assert any("m128n64" in f and "from float64" in f for f in wrong["failures"]), wrong
    # dv right, dk unwritten in one row: the pair fails
    holes = check(x, "dkdv", ["n128m32"], 1e-2, run=lambda x, w, c, out: (
        _into(out, triton_pass(x, w)), out[0][3].fill_(float("nan"))))
    assert len(holes["failures"]) == 2, holes


def test_the_dq_check_compares_gradients_of_q() -> None:
    x = _inputs()
    # the forward's output in place of dq: caught against both references
    bad = check(x, "dq", ["m64n64"], 1e-2, run=lambda x, w, c, out: _into(out, triton_pass(x, "forward")))
    assert len(bad["failures"]) == 2, bad


def test_unknown_names_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--cases", "edges,n9", "--configs", "m999", "--dkdv-configs", "n1"])
    assert "unknown case or config: n9, m999, n1" in capsys.readouterr().err


def test_isolate_runs_each_kernel_in_its_own_process_and_reports_crashes_and_hangs(tmp_path, capsys) -> None:
    """On this CPU-only machine each child dies (no CUDA): its verdict says so, with the error's tail, and the
    next kernel still runs; a child that does not exit in time is reported as hung."""
    out = tmp_path / "checks.json"
    status = main(["--isolate", "60", "--cases", "edges", "--configs", "m64n64", "--dq-configs", "",
                   "--dkdv-configs", "n128m32", "--seed", "5", "--out", str(out), "--jobs", "2"])
    assert status == 1
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("forward", "dkdv"))]
    assert [line.split()[:3] for line in lines] == [["forward", "m64n64", "crashed"], ["dkdv", "n128m32", "crashed"]]
    assert "CUDA" in lines[0] or "cuda" in lines[0], lines[0]
    import json

    record = json.loads(out.read_text())
    assert [r["verdict"] for r in record["results"]] == ["crashed", "crashed"] and record["meta"]["isolated"]
    assert main(["--isolate", "0.01", "--cases", "edges", "--configs", "m64n64", "--dq-configs", "",
                 "--dkdv-configs", ""]) == 1
    assert "hung" in capsys.readouterr().out


def test_a_case_names_the_tiles_the_triton_kernels_ran(capsys) -> None:
    """The Triton row of a table names its tiles from the tuner's record of the case's own launches,
    not from memory (session 28's table said 64 x 64 where the kernel ran 64 x 32)."""
    from attention_gluon import print_table

    from gem_kernels.attention_triton_autograd import last_configs

    x = _inputs()
    triton_pass(x, "forward")
    configs = last_configs()
    row = {"case": "c", "checks": {"forward": {"against_triton": {}, "against_float64": {"triton": 1e-3}, "failures": []}},
           "timed": {}, "triton_configs": configs}  # fmt: skip
    print_table([row], "forward")
    assert f"(c: the Triton forward ran {configs['forward']})" in capsys.readouterr().out
    assert configs["forward"].startswith("BLOCK_M=")
