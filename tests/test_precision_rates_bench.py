"""benchmarks/precision_rates.py on the CPU: the tiny config's linears timed under every scheme, with
the rows a step gives them, ranked as the profile's precision recommendation ranks them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark():
    spec = importlib.util.spec_from_file_location("precision_rates", ROOT / "benchmarks" / "precision_rates.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configs_linears_are_timed_and_ranked_on_this_device(tmp_path: Path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "rates.json"
    assert load_benchmark().main(["-c", str(ROOT / "configs" / "tiny.yaml"), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    schemes = data["rates"]["schemes"]
    assert {"fp32", "bf16", "fp8_rowwise", "fp8_tensorwise", "mxfp8", "as is"} <= set(schemes)
    assert all(schemes[n]["emulated"] for n in ("fp8_rowwise", "fp8_tensorwise", "mxfp8"))  # a CPU has no fp8 GEMMs
    linears = data["linears"]
    assert len(linears) == 15 and data["tokens"] > data["samples"] == 64
    for fqn, lin in linears.items():  # a block's linears see every token, the others a row per sample
        assert lin["rows"] == (data["tokens"] if fqn.startswith("blocks.") else data["samples"]), fqn
        assert lin["current"] == "fp32" and lin["order"][0] != "mxfp8"
        assert all(lin["why"][s]["kind"] == "emulated" for s in ("fp8_rowwise", "fp8_tensorwise", "mxfp8"))
    printed = capsys.readouterr().out
    assert "GEMM TFLOP/s" in printed and "blocks.0.uvqk" in printed
