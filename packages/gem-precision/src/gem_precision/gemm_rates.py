"""What each precision scheme's linears cost on the device at hand, measured there.

Per candidate scheme and per linear shape (``in x out`` at the rows of input the run gives it), on
the device, after a warm-up, with CUDA events on a GPU and the wall clock on a CPU (the same code):

- **the linear**: the scheme's converted module, forward and backward (``y = x W^T``, ``dx = g W``,
  ``dW = g^T x``) on an input in the run's activation dtype. This is what the linear costs in a
  run: its three GEMMs and every quantization or cast the scheme adds;
- **the GEMMs alone**: the same three products on operands made beforehand. For a scaled scheme
  (one with a recipe, :mod:`gem_precision.recipes`) it is the recipe's ``mm`` on operands that its
  ``quantize`` made: the backend ``resolved_backend`` names (fp8 ``torch._scaled_mm``, the cuBLAS or
  Triton MX GEMM, or the emulated dequantize-and-multiply), except a weight gradient the recipe
  computes from the unquantized ``g`` and ``x`` (``fp8_rowwise``'s ``weight_gradient: bf16``): a torch
  matmul in the activation dtype; or, with ``weight_gradient: fp8_blocks``, the e4m3 GEMM with 1 x 128
  block scales of :mod:`gem_precision.blockwise_weight_grad` on operands its two passes made beforehand
  (those passes count in the linear's time, as every other quantization does). For any other scheme it
  is a torch matmul in its ``gemm_dtype`` (a float8 scheme without a recipe has no GEMM-only figure).

The linear's time less the GEMMs' is what the scheme's quantization adds (on the fp8 path today a
separate pass over a bfloat16 input: where a producer kernel writes the fp8 copy, it is less).
Rates are ``3 x 2 x rows x in x out`` FLOPs over the time. Rows are capped at :data:`MAX_ROWS`:
past it a GEMM's time grows linearly, and :meth:`RateTable.seconds` scales to the run's rows.
Each (device, scheme and options, shape, rows, dtype) is measured once per process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gem_model.api import PrecisionScheme
from gem_precision.blockwise_weight_grad import block_scaled_mm, block_scaled_operands

MAX_ROWS = 32_768
"""Rows timed at most per shape: enough to fill an H200's tensor cores on the model's linears, and
a few ms per call."""
AS_IS = "as is"
"""The timing key of a linear no scheme converts (float32 inside, the core's kept linear)."""
GEMMS = 3


@dataclass(frozen=True)
class LinearShape:
    in_features: int
    out_features: int
    rows: int
    """Rows of input the run gives this linear per step (the timed rows are at most :data:`MAX_ROWS`)."""

    @property
    def key(self) -> str:
        return f"{self.in_features}x{self.out_features}@{self.rows}"

    @property
    def timed_rows(self) -> int:
        return max(1, min(self.rows, MAX_ROWS))

    def flops(self, rows: int) -> float:
        return GEMMS * 2.0 * rows * self.in_features * self.out_features


@dataclass
class Backend:
    name: str
    """``resolved_backend`` of a scaled scheme (``native``, ``triton``, ``emulated``, ...); ``torch`` else."""
    emulated: bool
    why: str
    error: str | None = None
    """Why the scheme cannot run on this device at all (then nothing is timed)."""


@dataclass
class Timing:
    """One scheme on one shape, at the shape's timed rows."""

    linear_s: float | None
    """The converted linear's forward and backward; None: it could not run (``error``)."""
    gemm_s: float | None
    """The three GEMMs alone; None where there is no separate GEMM to time or it failed."""
    rows: int
    error: str | None = None


@dataclass
class RateTable:
    """Every candidate's backend and timings on one device, by scheme name (and :data:`AS_IS`)."""

    device: str
    backends: dict[str, Backend]
    timings: dict[str, dict[str, Timing]] = field(default_factory=dict)
    """scheme -> :attr:`LinearShape.key` -> timing."""
    shapes: dict[str, LinearShape] = field(default_factory=dict)

    def seconds(self, scheme: str, shape: LinearShape) -> float | None:
        """The scheme's linear of ``shape`` per step at the run's rows, or None where it cannot run."""
        t = self.timings.get(scheme, {}).get(shape.key)
        if t is None or t.linear_s is None:
            return None
        return t.linear_s * shape.rows / t.rows if shape.rows > t.rows else t.linear_s

    def tflops(self, scheme: str, *, gemm_only: bool = False) -> float | None:
        """FLOPs over time summed over the shapes the scheme ran (at their timed rows)."""
        flops = secs = 0.0
        for key, t in self.timings.get(scheme, {}).items():
            s = t.gemm_s if gemm_only else t.linear_s
            if s is not None and s > 0:
                flops, secs = flops + self.shapes[key].flops(t.rows), secs + s
        return flops / secs / 1e12 if secs > 0 else None

    def quantization_share(self, scheme: str) -> float | None:
        """The part of the scheme's linear time that is not its GEMMs (quantization, casts)."""
        pairs = [(t.linear_s, t.gemm_s) for t in self.timings.get(scheme, {}).values()
                 if t.linear_s is not None and t.gemm_s is not None]  # fmt: skip
        total = sum(a for a, _ in pairs)
        return (total - sum(b for _, b in pairs)) / total if total > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "max_rows": MAX_ROWS,
            "schemes": {
                name: {**asdict(b), "gemm_tflops": self.tflops(name, gemm_only=True), "linear_tflops": self.tflops(name),
                       "quantization_share": self.quantization_share(name),
                       "shapes": {k: asdict(t) for k, t in self.timings.get(name, {}).items()}}
                for name, b in self.backends.items()
            },
        }  # fmt: skip


Measure = Callable[[dict[str, PrecisionScheme], list[LinearShape], torch.device, torch.dtype], RateTable]
"""What the profile calls to get a :class:`RateTable`: :func:`measure_rates`, or a stand-in in tests."""

_TIMINGS: dict[tuple[Any, ...], Timing] = {}


def measure_rates(
    schemes: dict[str, PrecisionScheme], shapes: list[LinearShape], device: torch.device, dtype: torch.dtype
) -> RateTable:
    """Time every scheme (and a linear left as is) on every shape; see the module doc."""
    table = RateTable(str(device), {AS_IS: Backend("torch", False, "float32 matmul (the linear left as is)")},
                      shapes={s.key: s for s in shapes})  # fmt: skip
    table.backends.update({name: backend_of(scheme, device) for name, scheme in schemes.items()})
    for name, backend in table.backends.items():
        scheme = schemes.get(name)
        if backend.error is not None:
            continue
        table.timings[name] = {s.key: _timed(scheme, s, device, dtype) for s in shapes}
    return table


def backend_of(scheme: PrecisionScheme, device: torch.device) -> Backend:
    resolve = getattr(scheme, "resolved_backend", None)
    if resolve is None:
        dtype = scheme.gemm_dtype
        return Backend(
            "torch", False, f"a torch matmul in {dtype}" + ("" if dtype == "float32" else " (cast, no scales)")
        )
    try:
        name = resolve(device)
    except (RuntimeError, ValueError) as exc:
        return Backend("-", False, "-", error=f"{type(exc).__name__}: {exc}")
    explain = getattr(scheme, "backend_reason", None)
    return Backend(name, name == "emulated", explain(device) if explain is not None else f"backend {name!r}")


def _timed(scheme: PrecisionScheme | None, shape: LinearShape, device: torch.device, dtype: torch.dtype) -> Timing:
    config = None if scheme is None else scheme.config.model_dump_json()
    key = (str(device), None if scheme is None else scheme.name, config, shape.in_features, shape.out_features,
           shape.timed_rows, dtype)  # fmt: skip
    if key not in _TIMINGS:
        _TIMINGS[key] = _time_one(scheme, shape, device, dtype)
    return _TIMINGS[key]


def _time_one(scheme: PrecisionScheme | None, shape: LinearShape, device: torch.device, dtype: torch.dtype) -> Timing:
    rows = shape.timed_rows
    gen = torch.Generator(device=device).manual_seed(0)
    linear = nn.Linear(shape.in_features, shape.out_features)
    x = torch.randn(rows, shape.in_features, generator=gen, device=device, dtype=dtype).requires_grad_(True)
    g = torch.randn(rows, shape.out_features, generator=gen, device=device, dtype=dtype)
    try:
        module = _converted(scheme, linear).to(device)
        params = [p for p in module.parameters() if p.requires_grad]

        def step() -> None:
            y = module(x).to(dtype)
            torch.autograd.grad(y, [x, *params], g)

        linear_s = _seconds(step, device)
    except (RuntimeError, ValueError, TypeError) as exc:
        return Timing(None, None, rows, f"{type(exc).__name__}: {exc}")
    try:
        gemm_s = _gemm_seconds(scheme, linear.to(device), x.detach(), g, device)
    except (RuntimeError, ValueError, TypeError) as exc:
        return Timing(linear_s, None, rows, f"GEMMs alone: {type(exc).__name__}: {exc}")
    return Timing(linear_s, gemm_s, rows)


class _Kept(nn.Module):
    """A linear left out of the scheme: float32 inside, the activation dtype outside (as the core keeps it)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x.float()).to(x.dtype)


def _converted(scheme: PrecisionScheme | None, linear: nn.Linear) -> nn.Module:
    converted = linear if scheme is None else scheme.convert_linear(linear, "rate")
    return _Kept(converted) if type(converted) is nn.Linear else converted


def _gemm_seconds(
    scheme: PrecisionScheme | None, linear: nn.Linear, x: torch.Tensor, g: torch.Tensor, device: torch.device
) -> float | None:
    w = linear.weight.detach()
    recipe_for = getattr(scheme, "recipe_for", None)
    if recipe_for is not None:
        recipe = recipe_for(device)
        hp_dw = recipe.high_precision_weight_grad  # dW = g^T x from g and x as given, no transposed operands
        xq = recipe.quantize(x.contiguous(), role="input", rows=True, cols_t=not hp_dw)
        wq = recipe.quantize(w.contiguous(), role="weight", rows=True, cols_t=True)
        gq = recipe.quantize(g.contiguous(), role="grad", rows=True, cols_t=not hp_dw)
        blocks = None  # dW's e4m3 operands with 1 x 128 block scales, made by backward's two passes
        if recipe.block_scaled_weight_grad:
            blocks = block_scaled_operands(g.contiguous(), x.contiguous(), native=recipe.native)

        def gemms() -> None:
            recipe.mm(xq.rows, wq.rows, out_dtype=x.dtype, role="forward")
            recipe.mm(gq.rows, wq.cols_t, out_dtype=x.dtype, role="grad_input")
            if blocks is not None:
                block_scaled_mm(*blocks, native=recipe.native)
            elif hp_dw:
                g.t() @ x
            else:
                recipe.mm(gq.cols_t, xq.cols_t, out_dtype=torch.float32, role="grad_weight")

        return _seconds(gemms, device)
    dtype = torch.float32 if scheme is None else getattr(torch, scheme.gemm_dtype, None)
    if dtype is None or dtype.itemsize < 2:
        return None  # a float8 scheme without a recipe: no plain matmul stands for its GEMMs
    a, b, c = x.to(dtype), w.to(dtype), g.to(dtype)

    def matmuls() -> None:
        F.linear(a, b)  # y = x W^T
        c @ b  # dx = g W
        c.t() @ a  # dW = g^T x

    return _seconds(matmuls, device)


def _seconds(fn: Callable[[], None], device: torch.device, *, warmup: int = 2, iters: int = 5) -> float:
    """Seconds per call of ``fn`` on ``device`` after ``warmup`` calls (which also compile and tune kernels)."""
    with torch.enable_grad():
        for _ in range(warmup):
            fn()
        if device.type != "cuda":
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            return (time.perf_counter() - start) / iters
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        begin.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / iters
