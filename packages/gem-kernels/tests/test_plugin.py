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
from gem_kernels.next_item_loss import TritonNextItemLoss
from gem_kernels.norm_gate import TorchNormGate, TritonNormGate
from gem_kernels.sequence_input import TritonSequenceInput
from gem_kernels.sequence_pool import TritonSequencePool
from gem_model.api import Kernel
from gem_model.errors import KernelUnavailableError
from gem_model.model.next_item import TorchNextItemLoss, next_item_loss
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
    loss = pm.kernel_registry("next_item_loss")  # its torch kernel is gem-model's own, registered beside
    assert loss.names() == ["torch", "triton"]
    assert loss.get("torch").cls is TorchNextItemLoss and loss.get("torch").provider.distribution == "gem-model"
    assert loss.get("triton").cls is TritonNextItemLoss
    for op, triton_cls in (("sequence_input", TritonSequenceInput), ("sequence_pool", TritonSequencePool)):
        ends = pm.kernel_registry(op)  # the sequence tower's two ends: torch is gem-model's own
        assert ends.names() == ["torch", "triton"] and ends.get("torch").provider.distribution == "gem-model"
        assert ends.get("triton").cls is triton_cls


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
@pytest.mark.parametrize("kernel", [TritonJaggedAttention(), TritonNormGate(), TritonNextItemLoss(),
                                    TritonSequenceInput(), TritonSequencePool()],
                         ids=["attention", "norm_gate", "next_item_loss", "sequence_input", "sequence_pool"])  # fmt: skip
def test_triton_on_cpu_without_the_interpreter_is_an_error(kernel: Kernel) -> None:
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
    args, options = loss_inputs(torch.bfloat16, per_position=False)
    with pytest.raises(KernelUnavailableError, match=r"kernels\.next_item_loss: 'triton' cannot run here"):
        TritonNextItemLoss()(*args, **options)
    lengths = torch.tensor([2, 1])
    with pytest.raises(KernelUnavailableError, match=r"kernels\.sequence_pool: 'triton' cannot run here"):
        TritonSequencePool()(x, torch.ones(16), torch.zeros(16), 1e-5, torch.tensor([0, 3, 5]), lengths,
                             lead=0, candidate=True, max_len=4)  # fmt: skip
    with pytest.raises(KernelUnavailableError, match=r"kernels\.sequence_input: 'triton' cannot run here"):
        TritonSequenceInput()(x[:3], x[:3], lengths, scale=1.0, first=None, last=x[:2], position=None,
                              dtype=torch.float32, max_len=4)  # fmt: skip


def loss_inputs(dtype: torch.dtype, *, per_position: bool) -> tuple[tuple[torch.Tensor, ...], dict[str, object]]:
    """A small next-item batch (lengths 3, 0, 4; 2 negatives per sample or per predicted position)."""
    g = torch.Generator().manual_seed(0)
    lengths, k, d = torch.tensor([3, 0, 4]), 2, 16
    rows, negatives = 7, (5 if per_position else 3) * k
    args = (torch.randn(rows, d, generator=g).to(dtype), torch.randn(rows, d, generator=g),
            torch.randn(negatives, d, generator=g), lengths, torch.randint(9, (rows,), generator=g),
            torch.randint(9, (negatives,), generator=g))  # fmt: skip
    return args, {"num_negatives": k, "per_position": per_position, "l2_normalize": True, "temperature": 0.05}


@pytest.mark.usefixtures("no_interpreter")
@pytest.mark.parametrize(("dtype", "per_position"), [(torch.float32, False), (torch.bfloat16, True)])
def test_what_triton_does_not_fuse_is_the_cores_loss_anywhere(dtype: torch.dtype, per_position: bool) -> None:
    """float32 queries and per-position negatives run the core's torch loss: on CPU without the
    interpreter too, with its very bits."""
    args, options = loss_inputs(dtype, per_position=per_position)
    got, want = TritonNextItemLoss()(*args, **options), next_item_loss(*args, **options)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


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
