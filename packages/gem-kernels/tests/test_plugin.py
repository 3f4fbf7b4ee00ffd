"""Registration through the plugin hook, the kernels' configs, and the unavailable-kernel errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pydantic
import pytest
import torch

import gem_kernels.plugin
from gem_kernels import availability
from gem_kernels.attention import TorchJaggedAttention, TritonJaggedAttention
from gem_kernels.norm_gate import TorchNormGate, TritonNormGate
from gem_model.errors import KernelUnavailableError
from gem_model.plugins import GemPluginManager


def test_plugin_registers_every_kernel() -> None:
    pm = GemPluginManager(autoload=False, plugins=[gem_kernels.plugin])
    attention = pm.kernel_registry("jagged_attention")
    norm_gate = pm.kernel_registry("norm_gate")
    assert attention.names() == ["torch", "triton"]
    assert norm_gate.names() == ["torch", "triton"]
    assert attention.get("torch").cls is TorchJaggedAttention
    assert attention.get("triton").cls is TritonJaggedAttention
    assert norm_gate.get("torch").cls is TorchNormGate
    assert norm_gate.get("triton").cls is TritonNormGate


def test_plugin_imports_without_triton() -> None:
    """plugin.py must load on a machine where triton is missing or unusable."""
    code = "import sys; sys.modules['triton'] = None; import gem_kernels.plugin; print('ok')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_triton_config_options() -> None:
    assert TritonJaggedAttention.Config(dq="separate", block_m=32, block_n=16).block_m == 32
    with pytest.raises(pydantic.ValidationError, match="set together"):
        TritonJaggedAttention.Config(block_m=32)
    with pytest.raises(pydantic.ValidationError, match="powers of two"):
        TritonJaggedAttention.Config(block_m=48, block_n=16)
    with pytest.raises(pydantic.ValidationError):
        TritonJaggedAttention.Config(block=16)
    with pytest.raises(pydantic.ValidationError):
        TorchJaggedAttention.Config(anything=1)


@pytest.fixture
def no_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.usefixtures("no_interpreter")
@pytest.mark.parametrize("kernel", [TritonJaggedAttention(), TritonNormGate()], ids=["attention", "norm_gate"])
def test_triton_on_cpu_without_the_interpreter_is_an_error(kernel: TritonJaggedAttention | TritonNormGate) -> None:
    with pytest.raises(KernelUnavailableError, match=r"CUDA device.*TRITON_INTERPRET=1"):
        kernel.check_available(torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(KernelUnavailableError, match="no CUDA device"):
            kernel.check_available(torch.device("cuda"))


@pytest.mark.usefixtures("no_interpreter")
def test_calling_triton_on_cpu_tensors_without_the_interpreter_is_an_error() -> None:
    q = torch.randn(5, 1, 16)
    with pytest.raises(KernelUnavailableError, match=r"kernels\.jagged_attention: 'triton' cannot run here"):
        TritonJaggedAttention()(q, q, q, torch.tensor([0, 5]), max_seq_len=5, alpha=1.0)
    x = torch.randn(5, 16)
    with pytest.raises(KernelUnavailableError, match=r"kernels\.norm_gate: 'triton' cannot run here"):
        TritonNormGate()(x, x, torch.ones(16), torch.zeros(16), 1e-5)


def test_missing_triton_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(availability.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(KernelUnavailableError, match="pip install triton"):
        TritonJaggedAttention().check_available(torch.device("cuda"))


def test_triton_refuses_float64() -> None:
    q = torch.randn(5, 1, 16, dtype=torch.float64)
    with pytest.raises(KernelUnavailableError, match="float32, bfloat16 or float16"):
        TritonJaggedAttention()(q, q, q, torch.tensor([0, 5]), max_seq_len=5, alpha=1.0)


def test_torch_kernels_run_anywhere() -> None:
    TorchJaggedAttention().check_available(torch.device("cpu"))
    TorchNormGate().check_available(torch.device("cpu"))
