"""The example scheme against a float64 reference, and its registration."""

from __future__ import annotations

import torch
from torch import nn

import gem_plugin_example.plugin
from gem_model.plugins import GemPluginManager
from gem_plugin_example.fp16 import Fp16Gemm


def test_registered_under_its_name():
    pm = GemPluginManager(autoload=False, plugins=[gem_plugin_example.plugin])
    assert pm.precision_schemes.get("fp16_gemm").cls is Fp16Gemm


def test_matches_a_float64_linear_within_fp16_precision():
    torch.manual_seed(int(torch.randint(0, 2**31, ()).item()))
    linear = nn.Linear(64, 32)
    converted = Fp16Gemm().convert_linear(linear, "x")
    x = torch.randn(16, 64)
    ref = nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    out = converted(x)
    assert out.dtype == torch.float32
    assert (out.double() - ref).norm() / ref.norm() < 2e-3
    assert dict(converted.named_parameters()).keys() == {"weight", "bias"}
    out.sum().backward()
    assert linear.weight.grad is not None and linear.weight.grad.dtype == torch.float32
