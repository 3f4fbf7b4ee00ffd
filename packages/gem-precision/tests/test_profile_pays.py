"""The numerics section recommends fewer GEMM bits for speed only where they run natively on the
profile's device: never on a CPU, never through an emulated backend."""

from __future__ import annotations

import pytest
import torch

from gem_model import testing
from gem_model.plugins import GemPluginManager
from gem_precision import plugin
from gem_precision.profile import pays_on
from gem_precision.schemes import ScaledScheme


@pytest.fixture
def pm() -> GemPluginManager:
    return GemPluginManager(autoload=False, plugins=[testing, plugin])


def test_nothing_pays_for_speed_on_a_cpu(pm):
    for name in ("bf16", "fp8_tensorwise", "fp8_rowwise", "mxfp8"):
        assert not pays_on(pm, name, torch.device("cpu")), name


@pytest.mark.parametrize(("backend", "pays"), [("native", True), ("emulated", False), ("triton", False)])
def test_on_a_gpu_only_a_native_backend_pays(pm, monkeypatch, backend, pays):
    monkeypatch.setattr(ScaledScheme, "resolved_backend", lambda self, device: backend)
    assert pays_on(pm, "mxfp8", torch.device("cuda")) is pays
    assert pays_on(pm, "bf16", torch.device("cuda"))  # no backend to choose: tensor cores run it


def test_a_backend_the_gpu_lacks_does_not_pay(pm, monkeypatch):
    def lacks(self, device):
        raise RuntimeError("precision scheme 'mxfp8': backend 'native' needs CUDA capability >= 10.0")

    monkeypatch.setattr(ScaledScheme, "resolved_backend", lacks)
    assert not pays_on(pm, "mxfp8", torch.device("cuda"))
