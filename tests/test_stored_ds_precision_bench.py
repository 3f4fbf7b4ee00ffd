"""benchmarks/stored_ds_precision.py: the exact ``ds`` it starts from is HSTU's, and the errors it reports are the
rounding's (bf16 about 2^-9, fp8 an order more), written as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark


def test_its_ds_is_the_attention_backward_s(monkeypatch):
    """``ds k`` from the script's ``ds`` is the ``dq`` autograd gives HSTU's causal silu attention (alpha 1 / sqrt D,
    no 1 / N), from the same draws."""
    bench = load_benchmark(monkeypatch, "stored_ds_precision.py")
    n, dim, seed = 40, 8, 3
    ds, k = bench.exact_ds(n, dim, seed)
    gen = torch.Generator().manual_seed(seed)
    q, k2, v = (torch.randn(n, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    grad_out = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    q.requires_grad_()
    s = (q @ k2.T) / dim**0.5
    out = (torch.nn.functional.silu(s) * torch.tril(torch.ones(n, n, dtype=torch.float64))) @ v
    (dq,) = torch.autograd.grad(out, q, grad_out)
    assert torch.equal(k, k2)
    torch.testing.assert_close(ds @ k / dim**0.5, dq, rtol=1e-10, atol=1e-12)


def test_it_reports_each_format_s_rounding_error(monkeypatch, tmp_path):
    bench = load_benchmark(monkeypatch, "stored_ds_precision.py")
    out = tmp_path / "r.json"
    assert bench.main(["--n", "128", "--dim", "16", "--seed", "5", "--out", str(out)]) == 0
    rows = {r["ds kept in"]: r["relative error"] for r in json.loads(out.read_text())["rows"]}
    assert 5e-4 < rows["bf16"] < 5e-3  # bf16 keeps 8 bits: ~2^-9 a value
    for name in ("e4m3, a scale a tile", "e4m3, a scale a tile row", "e4m3, a scale a key of a tile"):
        assert 4 * rows["bf16"] < rows[name] < 0.1
    assert rows["e4m3, a scale a tile"] < rows["e5m2, a scale a tile"]  # one mantissa bit fewer
