"""``fp16_gemm``: float16 GEMMs with fp32 master weights and an fp32 output."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from gem_model.api import ComponentConfig, PrecisionScheme


class Fp16GemmConfig(ComponentConfig):
    output_fp32: bool = Field(True, description="cast the GEMM result back to float32")


class Fp16Linear(nn.Module):
    """Keeps the original Parameters (same names), computes in float16."""

    def __init__(self, linear: nn.Linear, output_fp32: bool):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.output_fp32 = output_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.half() if self.bias is not None else None
        y = F.linear(x.half(), self.weight.half(), bias)
        return y.float() if self.output_fp32 else y


class Fp16Gemm(PrecisionScheme):
    name: ClassVar[str] = "fp16_gemm"
    gemm_dtype: ClassVar[str] = "float16"
    Config = Fp16GemmConfig
    config: Fp16GemmConfig

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        return Fp16Linear(linear, self.config.output_fp32)
