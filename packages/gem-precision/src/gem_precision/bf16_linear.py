"""The ``bf16`` scheme's linear: bfloat16 GEMMs from float32 master weights, with float32 gradients
written by the GEMM and the reduction that compute them.

Cast per call and left to autograd (``F.linear(x, weight.to(bf16), bias.to(bf16))``), the backward
computes ``dW`` and ``db`` in bfloat16 and then casts each to float32 in a launch of its own
(``ToCopyBackward0``): two more kernels per linear a step, 72 on the H200's big config, each a point
where the device may wait for the host. Here, on a GPU, :class:`Bf16LinearFunction` asks the weight
GEMM for a float32 output (``torch.mm(..., out_dtype=torch.float32)``: bf16 operands, float32
accumulation, as before, but no rounding to bf16 in between) and sums the bias gradient into float32
directly. The forward is unchanged.

A fused block may supply the forward GEMM (``gem_model.api.LinearGemm``: gem-kernels' uvqk projection
writes the silu of its output in the GEMM's epilogue): ``Bf16Linear(x, gemm=...)`` runs it in place of
``F.linear`` through the same function, so the backward stays this one (``takes_gemm``: not under
``torch.compile``, nor for a DTensor weight).

The bias gradient is the column sums of the output gradient: one more read of it. When the kernel that
writes that gradient can sum it in the same pass (the next HSTU block's layer norm backward writes the
gradient of the block's ``out`` linear), the linear makes a slot for the sums alone
(:meth:`Bf16Linear.grad_rows_slot`, ``gem_model.api.GradRowsSlot(rows=False)``) and its backward takes
them from there (:data:`BIAS_SUMS_FROM_PRODUCER`).

Elsewhere (the CPU has no ``mm`` with ``out_dtype``; a DTensor weight under tensor parallelism has no
sharding rule for it) the gradients are computed as autograd computed them, in bf16 and then cast:
the CPU's bits are those of the plain form.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from gem_model.api import GradRowsSlot, LinearGemm
from gem_precision.cast_cache import CastCache
from gem_precision.device import triton_interpreting

BF16 = torch.bfloat16

FLOAT32_GRADS = True
"""Whether a GPU linear writes its float32 gradients directly (False: autograd's bf16 gradients and
their casts, the form before; ``benchmarks/ab_switches_precision.py`` measures one against the other)."""

CAST_ONCE = False
"""Whether a GPU linear of the ``bf16`` scheme reads its bf16 weight and bias from the scheme's
:class:`~gem_precision.cast_cache.CastCache` (remade once per optimizer step, every linear's in one
launch) instead of casting them at each call (read at call time; not under ``torch.compile``, which
fuses the casts itself). Off until timed on a GPU (e2e switch ``cast_once``). It may be switched either way
between steps: the linears register their parameters with the cache when converted, whatever its value.

A weight or bias the cache does not know (neither the parameter the linear was converted with nor the
alias ``gem_model.api.bias_grad_elsewhere`` lends in its place: a parameter replaced since, by
``load_state_dict(assign=True)`` or a wrapper that swaps parameters in) is
cast at each call instead, which gives the same bits, with one warning per linear naming it: a switch
that only saves time should not stop a run, but should not silently do nothing either.
``linear.use_cast_cache(linear.cast_cache)`` registers the parameters it has now."""


BIAS_GRAD_KERNEL = True
"""Whether a linear's bias gradient of at least :data:`BIAS_GRAD_KERNEL_ROWS` rows is summed by
:func:`gem_precision.column_sums_triton.column_sums` instead of torch's reduction (read at call time; e2e
switch ``torch_bias_grad`` gives torch's back). 0.148 against 0.165 ms a call on the H100
(``benchmarks/reduction_passes.py``, 2026-12-06); with the unit-rows kernel the step ran 1.005-1.007x
(steady 1.009-1.010x) on two seeds. On since then."""
BIAS_GRAD_KERNEL_ROWS = 8192
"""Below this many rows torch's reduction is a few microseconds either way."""

BIAS_SUMS_FROM_PRODUCER = True
"""Whether a GPU linear whose bias takes a gradient asks the kernel that writes its output gradient for that
gradient's column sums (:meth:`Bf16Linear.grad_rows_slot`; read when the slot is asked for, at the forward).
With gem-kernels' layer norm summing them (the fused block's ``out`` linears but the last): on the H100
(2026-12-06) the pass with its sums 0.583 ms against 0.689 for the pass and ``column_sums`` at 207,000 x 1,024
(``benchmarks/reduction_passes.py``), the step 1.006x / 1.003x over 60 batches on two seeds (steady
1.004x / 1.005x; ``benchmarks/results/e2e_ab.md``). On since then; e2e switch ``bias_sums_in_linear`` turns it
off."""


def bias_grad(grad_2d: torch.Tensor) -> torch.Tensor:
    """``grad_2d.sum(0)`` in float32: the bias gradient of a linear whose output gradient is ``grad_2d``."""
    if BIAS_GRAD_KERNEL and grad_2d.shape[0] >= BIAS_GRAD_KERNEL_ROWS and (grad_2d.is_cuda or triton_interpreting()):
        from gem_precision.column_sums_triton import column_sums  # imports triton

        return column_sums(grad_2d)
    return grad_2d.sum(0, dtype=torch.float32)


def float32_weight_grad(grad_2d: torch.Tensor, x_2d: torch.Tensor) -> torch.Tensor:
    """``grad_2d.T @ x_2d`` (bf16 operands, float32 accumulation) as a float32 tensor: written as float32
    by the GEMM on a GPU, rounded to bf16 and cast elsewhere (the CPU has no ``mm`` with ``out_dtype``)."""
    if grad_2d.is_cuda and FLOAT32_GRADS:
        return torch.mm(grad_2d.t(), x_2d, out_dtype=torch.float32)
    return torch.mm(grad_2d.t(), x_2d).float()


class Bf16LinearFunction(torch.autograd.Function):
    """``F.linear(x, weight.to(bf16), bias.to(bf16))`` for a bf16 ``x`` on a GPU, whose backward writes
    the float32 gradients of the float32 ``weight`` and ``bias`` without a cast pass (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                w16: torch.Tensor | None = None, b16: torch.Tensor | None = None,
                gemm: LinearGemm | None = None, grad_rows: GradRowsSlot | None = None) -> torch.Tensor:
        """``w16``, ``b16``: the weight and bias already in bf16 (a :class:`CastCache`'s copies), else cast
        here. ``gemm``: the forward GEMM a fused kernel supplies (``gem_model.api.LinearGemm``, on ``x``'s
        rows), else ``F.linear``. ``grad_rows``: the slot the output gradient's column sums may be offered
        through (:meth:`Bf16Linear.grad_rows_slot`)."""
        if w16 is None:
            w16 = weight.to(BF16)
        if bias is not None and b16 is None:
            b16 = bias.to(BF16)
        if gemm is None:
            y = F.linear(x, w16, b16)
        else:
            y = gemm(x.reshape(-1, x.shape[-1]), w16, b16).view(*x.shape[:-1], w16.shape[0])
        ctx.save_for_backward(x, w16)
        ctx.grad_rows = grad_rows
        ctx.weight_dtype = weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w16 = ctx.saved_tensors
        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        g2 = grad.reshape(-1, grad.shape[-1])
        dx = dw = db = None
        if need_dx:
            dx = grad.matmul(w16)
        if need_dw:
            dw = float32_weight_grad(g2, x.reshape(-1, x.shape[-1])).to(ctx.weight_dtype)
        offered = ctx.grad_rows.take(g2) if ctx.grad_rows is not None else None
        if need_db:
            sums = offered.column_sum if offered is not None else None
            db = (bias_grad(g2) if sums is None else sums).to(ctx.bias_dtype)
        return dx, dw, db, None, None, None, None


def _direct(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the float32 gradients can be written directly: on a GPU, with a weight that is no DTensor."""
    return FLOAT32_GRADS and x.is_cuda and not isinstance(weight, DTensor)


class SchemeLinear(nn.Module):
    """What a precision scheme's module keeps of the ``nn.Linear`` it replaces: its sizes and its
    Parameters (float32 master weights, the same names, so checkpoints and optimizers see no change),
    and its fully qualified name for messages."""

    def __init__(self, linear: nn.Linear, *, fqn: str):
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self.fqn = fqn


class Bf16Linear(SchemeLinear):
    """Drop-in for an ``nn.Linear`` computing its GEMMs in bfloat16 from float32 master weights.

    The weight and bias are cast to bfloat16 for each call; their gradients reach them in float32
    (module docstring). The output has the dtype of the input (bfloat16 when the model's activations
    are)."""

    cast_cache: CastCache | None = None
    _warned_uncached = False

    def use_cast_cache(self, cache: CastCache) -> None:
        """Read the bf16 weight and bias from ``cache`` (shared by the scheme's linears) where :data:`CAST_ONCE`."""
        self.cast_cache = cache
        cache.add(self.weight)
        cache.add(self.bias)
        self._warned_uncached = False

    def _cached(self, cache: CastCache) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The bf16 weight and bias from ``cache``; None for one it does not know (cast per call: :data:`CAST_ONCE`)."""
        w16 = cache.find(self.weight)
        b16 = None if self.bias is None else cache.find(self.bias)
        if (w16 is None or (self.bias is not None and b16 is None)) and not self._warned_uncached:
            self._warned_uncached = True
            missing = ", ".join(name for name, t, t16 in (("weight", self.weight, w16), ("bias", self.bias, b16))
                                if t is not None and t16 is None)  # fmt: skip
            warnings.warn(f"{self.fqn}: CAST_ONCE is on but the cast cache does not know this linear's {missing} "
                          "(replaced since the linear was converted?); cast at each call instead, same bits. "
                          "linear.use_cast_cache(linear.cast_cache) registers the current parameters.", stacklevel=3)
        return w16, b16

    def takes_gemm(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` runs a supplied forward GEMM (``gem_model.api.takes_gemm``): not for a
        DTensor weight (tensor parallelism's sharding rules are ``F.linear``'s), nor under ``torch.compile``."""
        return not isinstance(self.weight, DTensor) and not torch.compiler.is_compiling()

    def grad_rows_slot(self, device: torch.device) -> GradRowsSlot | None:
        """The slot through which backward takes its bias gradient, the column sums of its output gradient,
        from the kernel that writes that gradient (``gem_model.api.GradRowsSlot`` asking for no rows): on a
        GPU, where the gradients are written directly, for a bias that takes a gradient, under
        :data:`BIAS_SUMS_FROM_PRODUCER`; else None (the linear sums the gradient itself)."""
        if not BIAS_SUMS_FROM_PRODUCER or self.bias is None or not self.bias.requires_grad:
            return None
        if device.type != "cuda" or not FLOAT32_GRADS or isinstance(self.weight, DTensor):
            return None
        return GradRowsSlot(column_sum=True, rows=False)

    def forward(self, x: torch.Tensor, *, gemm: LinearGemm | None = None,
                grad_rows: GradRowsSlot | None = None) -> torch.Tensor:  # fmt: skip
        """``gemm``: the forward GEMM a fused kernel supplies (``gem_model.api.takes_gemm``). ``grad_rows``:
        the slot :meth:`grad_rows_slot` made, through which backward may take its bias gradient."""
        x16 = x.to(BF16)
        if gemm is not None and not self.takes_gemm(x16):
            raise ValueError(f"{self.fqn}: a supplied GEMM runs only where takes_gemm(x) is true")
        if grad_rows is not None and not isinstance(grad_rows, GradRowsSlot):
            raise TypeError(f"{self.fqn}: grad_rows must be a GradRowsSlot, got {type(grad_rows).__name__}")
        if (_direct(x16, self.weight) or gemm is not None) and x16.numel():
            cache = self.cast_cache
            if CAST_ONCE and cache is not None and not torch.compiler.is_compiling():
                w16, b16 = self._cached(cache)
                return Bf16LinearFunction.apply(x16, self.weight, self.bias, w16, b16, gemm, grad_rows).to(x.dtype)
            return Bf16LinearFunction.apply(x16, self.weight, self.bias, None, None, gemm, grad_rows).to(x.dtype)
        bias = None if self.bias is None else self.bias.to(BF16)
        return F.linear(x16, self.weight.to(BF16), bias).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, scheme=bf16"
