"""The precision policy of the core (gem_model.precision), on inline schemes only."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gem_model.components import PrecisionScheme
from gem_model.config import PrecisionConfig, ref
from gem_model.precision import KeptLinear, activation_dtype_of, apply_precision


class Bf16Out(nn.Module):
    """A scheme's module that computes in bfloat16 and (deliberately) returns float32."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.bfloat16(), self.weight.bfloat16(), self.bias.bfloat16()).float()


class Bf16Activations(PrecisionScheme):
    name: ClassVar[str] = "bf16_acts"
    activation_dtype: ClassVar[str] = "bfloat16"

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        return Bf16Out(linear)


class Odd(PrecisionScheme):
    name: ClassVar[str] = "odd"
    activation_dtype: ClassVar[str] = "float16"

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        return linear


class Refusing(Bf16Activations):
    name: ClassVar[str] = "refusing"

    def check_module(self, module: nn.Module, fqn: str, device: torch.device) -> None:
        raise ValueError("no GEMM for this shape here")


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wide = nn.Linear(32, 32)
        self.narrow = nn.Linear(8, 32)
        self.activation_dtype = torch.float32

    def set_activation_dtype(self, dtype: torch.dtype) -> None:
        self.activation_dtype = dtype

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        return self.wide(self.narrow(dense.to(self.activation_dtype)))


SCHEMES = {s.name: s() for s in (Bf16Activations, Odd, Refusing)}


def test_kept_and_converted_linears_return_the_activation_dtype() -> None:
    model = Tiny()
    names = [n for n, _ in model.named_parameters()]
    policy = apply_precision(model, PrecisionConfig(scheme=ref("bf16_acts"), min_dim=16), SCHEMES)
    assert policy.activation_dtype == torch.bfloat16 and model.activation_dtype == torch.bfloat16
    assert policy.plan == {"wide": "bf16_acts", "narrow": None}
    assert isinstance(model.narrow, KeptLinear) and isinstance(model.wide, Bf16Out)
    assert [n for n, _ in model.named_parameters()] == names  # same parameter names, same masters
    assert all(p.dtype == torch.float32 for p in model.parameters())
    x = torch.randn(5, 8)
    assert model.narrow(x.bfloat16()).dtype == torch.bfloat16
    y = model(x)
    assert y.dtype == torch.bfloat16  # Bf16Out returns float32; the core casts it back
    with torch.no_grad():  # the same ops by hand: bf16 input, fp32 kept linear, bf16 GEMM
        hidden = F.linear(x.bfloat16().float(), model.narrow.weight, model.narrow.bias).bfloat16()
        want = F.linear(hidden, model.wide.weight.bfloat16(), model.wide.bias.bfloat16())
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    y.float().sum().backward()
    assert model.narrow.weight.grad is not None and model.narrow.weight.grad.dtype == torch.float32


def test_float32_activations_leave_kept_linears_alone() -> None:
    model = Tiny()
    config = PrecisionConfig(scheme=ref("bf16_acts"), min_dim=16, activation_dtype="float32")
    policy = apply_precision(model, config, SCHEMES)
    assert policy.activation_dtype == torch.float32 and type(model.narrow) is nn.Linear
    assert model(torch.randn(3, 8)).dtype == torch.float32


def test_a_scheme_declaring_an_unknown_activation_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="precision.scheme 'odd' declares activation_dtype 'float16'"):
        activation_dtype_of(PrecisionConfig(scheme=ref("odd")), SCHEMES)


def test_check_module_refuses_before_training_naming_the_linear() -> None:
    with pytest.raises(ValueError, match="precision: wide under scheme 'refusing' cannot run on cpu: no GEMM"):
        apply_precision(Tiny(), PrecisionConfig(scheme=ref("refusing"), min_dim=16), SCHEMES, torch.device("cpu"))


def test_a_model_without_set_activation_dtype_cannot_take_16_bit_activations() -> None:
    with pytest.raises(ValueError, match="needs a model with set_activation_dtype"):
        apply_precision(nn.Sequential(nn.Linear(4, 4)), PrecisionConfig(scheme=ref("bf16_acts")), SCHEMES)
