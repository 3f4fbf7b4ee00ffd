"""The precision schemes registered by gem-precision: ``fp32``, ``bf16``, ``fp8_tensorwise``,
``fp8_rowwise`` and ``mxfp8``.

A scheme only converts the linears the core hands it (embedding tables are never touched) into
modules that keep the original ``weight``/``bias`` Parameters as float32 master weights.

Backends of the scaled schemes (option ``backend``), resolved per device at the first forward:

- ``native``: the fast path; raises a clear error on a device that lacks it.
- ``emulated``: same quantization numerics (bit for bit), then dequantize and a float32 matmul. Runs
  anywhere; CI tests the schemes this way.
- ``auto``: ``native`` where the device has it, else ``emulated`` (fp8 schemes); for ``mxfp8`` the
  cuBLAS block-scaled GEMM on CUDA >= 10.0 (after a one-time probe against the reference), else the
  Triton GEMM on CUDA >= 8.9, else ``emulated``. The choice is logged once per device and returned
  by :meth:`ScaledScheme.resolved_backend`.

Weight gradient of ``fp8_rowwise`` (option ``weight_gradient``): ``bf16`` (the default) computes
``dW = g.T @ x`` in bfloat16 from the unquantized ``x`` and ``grad_out``, so neither is quantized
along the tokens (see :mod:`gem_precision.scaled_linear`); ``fp8`` quantizes both along the tokens
for an fp8 GEMM, at the cost of a stats and a cast pass over each, which on the H200 cost more than
the fp8 GEMM saves; ``fp8_blocks`` keeps ``bf16``'s forward (``x`` saved as given, no transposed
operand) and makes both operands in backward, in e4m3 with a power-of-two scale per feature and block
of 128 tokens, one pass each, for an fp8 GEMM with those block scales
(:mod:`gem_precision.blockwise_weight_grad`).

Gradient format of the fp8 schemes (option ``grad_format``). ``fp8_rowwise`` defaults to e4m3: each
row of ``grad_out`` (one token) and each column (one feature, for the weight gradient) gets its own
scale, which already follows the gradient's dynamic range across tokens and features, so e5m2's
extra range buys nothing and its 2 mantissa bits would double the rounding error of e4m3's 3.
``fp8_tensorwise`` defaults to e5m2: a single scale per tensor is set by the largest gradient, and
tokens with small gradients sit many binades below it; e5m2 covers ~32 binades (to 2**-16) against
e4m3's ~18 (to 2**-9), so those rows keep significant bits instead of flushing to zero.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import nn

from gem_model.api import ComponentConfig, PrecisionScheme
from gem_precision.bf16_linear import Bf16Linear
from gem_precision.cast_cache import CastCache
from gem_precision.device import (
    FP8_MIN_CAPABILITY,
    MX_NATIVE_MIN_CAPABILITY,
    can_run_triton,
    describe,
    has_capability,
)
from gem_precision.formats import fp8_format
from gem_precision.recipes import Fp8Recipe, LinearRecipe, MXRecipe
from gem_precision.scaled_linear import ScaledLinear

log = logging.getLogger(__name__)


class Fp32Scheme(PrecisionScheme):
    """Leaves every linear as it is (float32 GEMMs)."""

    name: ClassVar[str] = "fp32"

    class Config(ComponentConfig):
        pass

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        return linear


class Bf16Scheme(PrecisionScheme):
    """bfloat16 GEMMs from float32 master weights (see :class:`Bf16Linear`); activations in bfloat16."""

    name: ClassVar[str] = "bf16"
    activation_dtype: ClassVar[str] = "bfloat16"
    gemm_dtype: ClassVar[str] = "bfloat16"

    class Config(ComponentConfig):
        pass

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        module = Bf16Linear(linear, fqn=fqn)
        cache = getattr(self, "_cast_cache", None)
        if cache is None:
            cache = self._cast_cache = CastCache()  # one for the linears this scheme converts
        module.use_cast_cache(cache)
        return module


class ScaledScheme(PrecisionScheme):
    """A scheme whose linears become :class:`ScaledLinear` with a per-device :class:`LinearRecipe`.

    Activations flow in bfloat16 between the GEMMs (each GEMM quantizes its own operands); the GEMMs
    run in fp8 (e4m3 elements; MX blocks too)."""

    activation_dtype: ClassVar[str] = "bfloat16"
    gemm_dtype: ClassVar[str] = "float8"

    def __init__(self, config: ComponentConfig | None = None):
        super().__init__(config)
        self._recipes: dict[torch.device, LinearRecipe] = {}

    @abstractmethod
    def _build_recipe(self, device: torch.device) -> LinearRecipe: ...

    def recipe_for(self, device: torch.device) -> LinearRecipe:
        recipe = self._recipes.get(device)
        if recipe is None:
            recipe = self._recipes[device] = self._build_recipe(device)
            log.info("precision scheme %s on %s: backend %s", self.name, describe(device), recipe.backend)
        return recipe

    def resolved_backend(self, device: torch.device | str) -> str:
        """The backend this scheme runs on ``device`` (raises if the configured one cannot run there)."""
        return self.recipe_for(torch.device(device)).backend

    def backend_reason(self, device: torch.device | str) -> str:
        """Why :meth:`resolved_backend` is what it is on ``device``, in words (the profile shows it)."""
        device = torch.device(device)
        backend = self.resolved_backend(device)
        if self.config.backend != "auto":
            return f"backend {backend!r} as configured"
        return self._auto_reason(backend, device)

    @abstractmethod
    def _auto_reason(self, backend: str, device: torch.device) -> str: ...

    def check_device(self, device: torch.device | str) -> None:
        """Fail now, not at the first step, if the configured backend cannot run on ``device``."""
        self.recipe_for(torch.device(device))

    def _unavailable(self, backend: str, device: torch.device, needs: str) -> RuntimeError:
        return RuntimeError(
            f"precision scheme {self.name!r}: backend {backend!r} needs {needs}; this run's device is "
            f"{describe(device)}. Use backend 'auto' (picks what the device has) or 'emulated'."
        )

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        return ScaledLinear(linear, scheme=self.name, fqn=fqn, recipe_for=self.recipe_for)

    def check_module(self, module: nn.Module, fqn: str, device: torch.device) -> None:
        if isinstance(module, ScaledLinear):
            module.recipe(device)  # raises for a backend the device lacks or a shape its GEMM cannot take


class _Fp8Config(ComponentConfig):
    backend: Literal["auto", "native", "emulated"] = Field(
        "auto", description="native: Triton-fused quantization + torch._scaled_mm (CUDA >= 8.9)"
    )
    fast_accum_forward: bool = Field(True, description="fast fp8 accumulation in the forward GEMM only")


class _Fp8Scheme(ScaledScheme):
    granularity: ClassVar[Literal["tensor", "row"]]

    def _build_recipe(self, device: torch.device) -> LinearRecipe:
        backend = self.config.backend
        has_native = has_capability(device, FP8_MIN_CAPABILITY)
        if backend == "native" and not has_native:
            raise self._unavailable(backend, device, "a CUDA device with compute capability >= 8.9")
        weight_gradient = getattr(self.config, "weight_gradient", "fp8")  # fp8_tensorwise has no option: fp8
        return Fp8Recipe(
            self.name,
            granularity=self.granularity,
            grad_format=fp8_format(self.config.grad_format),
            native=backend == "native" or (backend == "auto" and has_native),
            fast_accum_forward=self.config.fast_accum_forward,
            producer_rows=getattr(self.config, "producer_quantization", False),  # fp8_tensorwise has neither
            high_precision_weight_grad=weight_gradient in ("bf16", "fp8_blocks"),  # from g and x as saved
            block_scaled_weight_grad=weight_gradient == "fp8_blocks",
        )

    def _auto_reason(self, backend: str, device: torch.device) -> str:
        if backend == "native":
            return f"fp8 tensor cores on {describe(device)}: Triton quantization, torch._scaled_mm"
        return (f"no fp8 tensor cores on {describe(device)} (they need CUDA compute capability >= 8.9): "
                "quantized, dequantized and multiplied in float32")  # fmt: skip

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        if self.config.backend == "native":  # shapes are known now; the device only at forward
            problem = Fp8Recipe(
                self.name, granularity=self.granularity, grad_format=fp8_format("e4m3"), native=True,
                fast_accum_forward=False,
            ).shape_problem(linear.in_features, linear.out_features)  # fmt: skip
            if problem:
                raise ValueError(f"{fqn}: precision scheme {self.name!r}: {problem}; exclude this linear")
        return super().convert_linear(linear, fqn)


class Fp8TensorwiseScheme(_Fp8Scheme):
    """fp8 GEMMs with one dynamic power-of-two scale per tensor; e4m3 forward, e5m2 gradients."""

    name: ClassVar[str] = "fp8_tensorwise"
    granularity = "tensor"

    class Config(_Fp8Config):
        grad_format: Literal["e4m3", "e5m2"] = Field("e5m2", description="fp8 format of grad_output")


class Fp8RowwiseScheme(_Fp8Scheme):
    """fp8 GEMMs with dynamic power-of-two scales per row of the left operand and per column of the
    right one; e4m3 everywhere."""

    name: ClassVar[str] = "fp8_rowwise"
    granularity = "row"

    class Config(_Fp8Config):
        grad_format: Literal["e4m3", "e5m2"] = Field("e4m3", description="fp8 format of grad_output")
        producer_quantization: bool = Field(
            True,
            description="the kernels that produce a linear's input (the fused HSTU block's layer norm and "
            "norm-gate) write its e4m3 rows (and, with weight_gradient fp8, the column maxima), and the linear "
            "skips its own row quantization (gem_model.prequantized). With weight_gradient bf16 the rows alone "
            "cost the producers little; with weight_gradient fp8 the column maxima made the layer norm and "
            "norm-gate kernels slower (+13 ms a step on the H200's big config) than the passes they saved "
            "(-4 ms): 0.936x bf16 against 0.978x without (benchmarks/results/e2e_ab.md, 2026-12-02)",
        )
        weight_gradient: Literal["fp8", "bf16", "fp8_blocks"] = Field(
            "bf16",
            description="the GEMM of the weight gradient dW = grad_output.T @ x. bf16 (default): a bfloat16 GEMM "
            "with float32 accumulation, as the bf16 scheme computes it, on the bf16 input saved by the forward "
            "and the bf16 grad_output (torchao's rowwise_with_gw_hp recipe); the forward and the input gradient "
            "stay fp8, and no operand is quantized along the tokens. fp8: both operands quantized along the "
            "tokens (their transposed operands: x's made by the forward and saved, grad_output's in backward), "
            "which costs a stats and a cast pass over each. fp8_blocks: the forward and the input gradient as "
            "with bf16 (x saved as given, the same producer rows and gradient rows), and in backward both "
            "operands quantized from the bf16 grad_output and saved x, e4m3 with a power-of-two scale per "
            "feature and block of 128 tokens (DeepSeek-V3's recipe), in one pass each (Triton), for an fp8 "
            "GEMM with those block scales (torch._scaled_mm, BlockWise1x128). On one H200, big config, against "
            "bf16 batch by batch: bf16 here with producer_quantization 1.059x and 1.062x on two input mixes "
            "(1.026-1.039x before grad_output's rows took one pass), fp8 here 0.975x "
            "(benchmarks/results/e2e_ab.md, 2026-12-02). fp8_blocks on one H100: 0.968x bf16 here over steady "
            "rounds (e2e switch fp8_rowwise_dw_blocks, 2026-12-06): at the card's power cap its two cast passes "
            "cost more energy (0.70-0.77 J a block for uvqk) than its e4m3 GEMM saves (0.33-0.40 J)",
        )


class MXFP8Scheme(ScaledScheme):
    """MXFP8 (OCP MX v1.0): e4m3 elements, one e8m0 scale per 32 along each GEMM's reduction dim.

    Backends: ``native`` (cuBLAS block scaling, CUDA >= 10.0), ``triton`` (the Triton MX GEMM on fp8
    tensor cores, CUDA >= 8.9; on CPU under TRITON_INTERPRET=1 for tests), ``emulated`` and ``auto``.
    """

    name: ClassVar[str] = "mxfp8"

    class Config(ComponentConfig):
        backend: Literal["auto", "native", "triton", "emulated"] = "auto"

    def _build_recipe(self, device: torch.device) -> LinearRecipe:
        backend = self.config.backend
        if backend == "emulated":
            return MXRecipe(self.name, gemm="emulated", triton_quant=False)
        if backend == "triton":
            if not can_run_triton(device):
                raise self._unavailable(backend, device, "a CUDA device with compute capability >= 8.9")
            return MXRecipe(self.name, gemm="triton", triton_quant=True)
        native_problem = self._native_problem(device)
        if backend == "native":
            if native_problem:
                raise self._unavailable(backend, device, f"cuBLAS block-scaled MXFP8 ({native_problem})")
            return MXRecipe(self.name, gemm="native", triton_quant=True)
        if native_problem is None:  # auto
            return MXRecipe(self.name, gemm="native_or_triton", triton_quant=True)
        if has_capability(device, FP8_MIN_CAPABILITY):
            return MXRecipe(self.name, gemm="triton", triton_quant=True)
        return MXRecipe(self.name, gemm="emulated", triton_quant=False)

    def _auto_reason(self, backend: str, device: torch.device) -> str:
        if backend == "native_or_triton":
            return f"cuBLAS block-scaled MXFP8 on {describe(device)} (the Triton MX GEMM for shapes cuBLAS refuses)"
        no_native = f"no cuBLAS block-scaled MXFP8 on {describe(device)} ({self._native_problem(device)})"
        if backend == "triton":
            return f"{no_native}: the Triton MX GEMM on fp8 tensor cores"
        return (f"{no_native} and no fp8 tensor cores (CUDA compute capability >= 8.9): quantized, dequantized "
                "and multiplied in float32")  # fmt: skip

    @staticmethod
    def _native_problem(device: torch.device) -> str | None:
        if not has_capability(device, MX_NATIVE_MIN_CAPABILITY):
            return "needs CUDA compute capability >= 10.0"
        from gem_precision.mx_gemm import native_mx_probe

        return native_mx_probe(device.index if device.index is not None else torch.cuda.current_device())


SCHEMES: list[type[PrecisionScheme]] = [Fp32Scheme, Bf16Scheme, Fp8TensorwiseScheme, Fp8RowwiseScheme, MXFP8Scheme]
