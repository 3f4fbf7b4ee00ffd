"""benchmarks/weight_grad_blockwise.py on the CPU: its smoke run (the block quantizer in Triton's
interpreter, and what its operands stand for), its offer of every GEMM form to the device's torch, and
its choice among them: the first that runs and matches its operands' float64 product, never one that
runs with another reading of the scales."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported (as gem-kernels' conftest does)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark


def test_the_smoke_run_checks_the_operands(monkeypatch, capsys):
    bench = load_benchmark(monkeypatch, "weight_grad_blockwise.py")
    monkeypatch.setattr(sys, "argv", ["weight_grad_blockwise.py", "--smoke"])
    assert bench.main() == 0
    assert "dequantized operands' g^T x" in capsys.readouterr().out


def operands(bench):
    from gem_precision.fp8_blocks_triton import quantize_fp8_blocks_t_triton

    gen = torch.Generator().manual_seed(5)
    g, x = torch.randn(256, 24, generator=gen).bfloat16(), torch.randn(256, 40, generator=gen).bfloat16()
    return quantize_fp8_blocks_t_triton(g), quantize_fp8_blocks_t_triton(x)


def test_every_form_hands_torch_the_scale_shapes_its_check_names(monkeypatch):
    """``a [out, T]``, ``b [T, in]`` column-major, ``scale_a [out, T/128]`` outer-dim-major and ``scale_b
    [T/128, in]``: the shapes in torch's own message for BlockWise 1x128 (the CPU refuses them all: it has
    no blockwise GEMM)."""
    bench = load_benchmark(monkeypatch, "weight_grad_blockwise.py")
    gq, xq = operands(bench)
    a, b, sa, sb = bench._operands(gq, xq, False)
    assert a.shape == (24, 256) and a.stride() == (256, 1) and b.shape == (256, 40) and b.stride() == (1, 256)
    assert sa.shape == (24, 2) and sa.stride() == (1, 24) and sb.shape == (2, 40) and sb.stride() == (40, 1)
    names = [name for name, _ in bench.gemm_forms()]
    assert len(names) == len(set(names)) and any(n.startswith("torch._scaled_mm/rows/float32") for n in names)
    with pytest.raises(SystemExit, match="no blockwise fp8 GEMM form ran correctly"):
        bench.pick_gemm(gq, xq)


def test_the_first_correct_form_is_taken(monkeypatch):
    bench = load_benchmark(monkeypatch, "weight_grad_blockwise.py")
    gq, xq = operands(bench)

    def refuses(gq, xq):
        raise RuntimeError("not on this device")

    def reads_scales_transposed(gq, xq):  # runs, but with the other block's scales: must not be taken
        swapped = bench.dequantized(type(gq)(gq.data, gq.scale_inv.flip(1)))
        return (swapped @ bench.dequantized(xq).t()).float()

    def right(gq, xq):
        return (bench.dequantized(gq) @ bench.dequantized(xq).t()).float()

    forms = [("refuses", refuses), ("wrong", reads_scales_transposed), ("right", right), ("later", right)]
    monkeypatch.setattr(bench, "gemm_forms", lambda: forms)
    name, _, err, refused = bench.pick_gemm(gq, xq)
    assert name == "right" and err <= bench.GEMM_TOLERANCE
    assert refused["refuses"] == "not on this device" and "from its operands' float64 product" in refused["wrong"]


def test_the_forward_operands_are_blocks_of_the_right_tensors(monkeypatch):
    """``--forward``'s operands: ``W`` in 128 x 128 blocks (each block scaled as the row reference scales it,
    dequantized within e4m3's rounding) and ``x`` per token in blocks of 128 features, with the scale
    shapes torch's BlockWise128x128 and BlockWise1x128 name; their product is ``x W^T`` within e4m3."""
    bench = load_benchmark(monkeypatch, "weight_grad_blockwise.py")
    from gem_precision.formats import E4M3
    from gem_precision.fp8_reference import quantize_blocks_t_reference

    gen = torch.Generator().manual_seed(3)
    w = torch.randn(256, 384, generator=gen) * torch.logspace(-3, 3, 256)[:, None]  # blocks of other ranges
    wb = bench.square_blocks(w)
    assert wb.data.shape == (256, 384) and wb.scale_inv.shape == (2, 3)
    factors = wb.scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    w_hat = wb.data.double() * factors
    assert ((w_hat - w.double()).abs() <= torch.maximum(w.double().abs() * 2**-4, factors * 2**-10)).all()
    x = torch.randn(300, 384, generator=gen)
    xb = quantize_blocks_t_reference(x.t(), E4M3)
    assert xb.data.shape == (300, 384) and xb.scale_inv.shape == (300, 3) and xb.scale_inv.stride() == (1, 300)
    x_hat = xb.data.double() * xb.scale_inv.double().repeat_interleave(128, dim=1)
    assert bench.relative(x_hat @ w_hat.t(), x.double() @ w.double().t()) < 0.06
