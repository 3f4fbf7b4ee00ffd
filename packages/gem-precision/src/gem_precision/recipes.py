"""Recipes: how a scaled linear quantizes its operands and multiplies them, per scheme and backend.

Every GEMM of a linear is written ``a @ b.T`` with both operands quantized along their last dim, the
reduction dim of that GEMM (``y = x @ W.T``; ``dx = g @ W``, i.e. ``b = W.T``; ``dW = g.T @ x``).
A quantization of a 2-d tensor returns its row operand and/or its transposed operand, so one read of
``grad_out`` feeds both backward GEMMs. A recipe is picked per device by the scheme (see
:mod:`gem_precision.schemes`) and used by :class:`gem_precision.scaled_linear.ScaledLinearFunction`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import torch

from gem_model.api import PrequantizedRows
from gem_precision.formats import E4M3, Fp8Format
from gem_precision.fp8_reference import Fp8Operand, Fp8Pair, Granularity, quantize_fp8_reference
from gem_precision.mx_reference import MXTensor, mx_dequantize, mx_quantize

Role = Literal["input", "weight", "grad"]
GemmRole = Literal["forward", "grad_input", "grad_weight"]
SCALED_MM_ALIGN = 16  # torch._scaled_mm wants fp8 dims (reduction included) divisible by 16


@dataclass(frozen=True)
class Quantized:
    """One quantization of ``t [M, N]``: row operand ``[M, N]``, transposed operand ``[N, M(_pad)]``."""

    rows: Any | None
    cols_t: Any | None
    col_sum: torch.Tensor | None = None


class LinearRecipe(ABC):
    """Quantize and multiply for one scheme on one device."""

    scheme: str
    backend: str
    operand_type: type

    @abstractmethod
    def quantize(self, t: torch.Tensor, *, role: Role, rows: bool, cols_t: bool, col_sum: bool = False) -> Quantized:
        """Quantize a contiguous 2-d tensor; ``col_sum`` adds float32 ``t.sum(0)`` (a bias gradient)."""

    @abstractmethod
    def mm(
        self, a: Any, b: Any, *, out_dtype: torch.dtype, role: GemmRole, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``a @ b.T (+ bias)`` as ``out_dtype``."""

    def shape_problem(self, in_features: int, out_features: int) -> str | None:
        """Why this recipe cannot run a linear of this shape, or None."""
        return None

    @property
    def takes_prequantized_rows(self) -> bool:
        """Whether a linear's input may come pre-quantized by its producer (``gem_model.api.RowQuantization``:
        e4m3, a power-of-two scale per row). Only fp8 rowwise does: fp8 tensorwise's one scale needs the
        whole tensor's maximum, which no row's producer knows when it writes that row, and MXFP8's blocks
        of 32 are another format; both decline, and quantize their input themselves."""
        return False

    def quantize_prequantized(self, t: torch.Tensor, rows: PrequantizedRows, *, cols_t: bool) -> Quantized:
        """The input ``t`` quantized as :meth:`quantize` with ``role="input", rows=True`` would, its row
        operand taken from ``rows`` (the bits the producer wrote); only the transposed operand (for the
        weight gradient) is computed here. Also a gradient's rows (``cols_t=False``) when
        :attr:`grad_rows_in_rule`: the same rule then."""
        raise NotImplementedError(f"{self!r} takes no pre-quantized rows")

    @property
    def grad_rows_in_rule(self) -> bool:
        """Whether this recipe quantizes ``grad_output``'s rows by ``gem_model.api.RowQuantization``'s rule
        (e4m3, a power-of-two scale per row), so that the rows its producer wrote can stand for them."""
        return False

    @property
    def high_precision_weight_grad(self) -> bool:
        """Whether the weight gradient ``dW = g.T @ x`` is computed in backward from the unquantized ``g``
        and the ``x`` the forward saved as given, instead of by this recipe's GEMM on transposed operands
        that the quantization of ``g`` and the forward's of ``x`` make: then the forward makes no
        transposed operand of ``x`` (nor its producer the column maxima for one), and ``g``'s quantization
        no transposed operand of ``g``. The GEMM is one in the activation dtype (bf16 operands, float32
        accumulation, as the ``bf16`` scheme computes it), or, with :attr:`block_scaled_weight_grad`, an
        e4m3 GEMM on operands with 1 x 128 block scales made from ``g`` and ``x`` in backward. Only fp8
        rowwise offers it (its option ``weight_gradient``: ``bf16`` or ``fp8_blocks``)."""
        return False

    @property
    def block_scaled_weight_grad(self) -> bool:
        """Whether the weight gradient computed from the unquantized ``g`` and saved ``x``
        (:attr:`high_precision_weight_grad`, then also True) is the e4m3 GEMM with one power-of-two scale
        per feature and block of 128 tokens of :mod:`gem_precision.blockwise_weight_grad`. Only fp8
        rowwise offers it (``weight_gradient: fp8_blocks``)."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(scheme={self.scheme!r}, backend={self.backend!r})"


class Fp8Recipe(LinearRecipe):
    """fp8 with dynamic power-of-two scales per tensor or per row (see :mod:`gem_precision.fp8_reference`).

    ``native``: Triton fused quantization + ``torch._scaled_mm`` (CUDA >= 8.9). Otherwise emulated:
    the torch reference quantization (same bits), dequantize to float32 and ``torch.mm``.
    """

    operand_type = Fp8Operand

    def __init__(
        self,
        scheme: str,
        *,
        granularity: Granularity,
        grad_format: Fp8Format,
        native: bool,
        fast_accum_forward: bool,
        producer_rows: bool = False,
        high_precision_weight_grad: bool = False,
        block_scaled_weight_grad: bool = False,
    ):
        if block_scaled_weight_grad and not high_precision_weight_grad:
            raise ValueError("Fp8Recipe: block_scaled_weight_grad is computed from the unquantized g and saved x; "
                             "it needs high_precision_weight_grad=True")  # fmt: skip
        self.scheme = scheme
        self.granularity = granularity
        self.producer_rows = producer_rows
        self._high_precision_weight_grad = high_precision_weight_grad
        self._block_scaled_weight_grad = block_scaled_weight_grad
        self.grad_format = grad_format
        self.native = native
        self.backend = "native" if native else "emulated"
        self.fast_accum_forward = fast_accum_forward

    def quantize(self, t: torch.Tensor, *, role: Role, rows: bool, cols_t: bool, col_sum: bool = False) -> Quantized:
        fmt = self.grad_format if role == "grad" else E4M3
        pair = self._quantize(t, granularity=self.granularity, fmt=fmt, rows=rows, cols_t=cols_t, col_sum=col_sum)
        return Quantized(pair.rows, pair.cols_t, pair.col_sum)

    def _quantize(self, t: torch.Tensor, **kwargs: Any) -> Fp8Pair:
        if self.native:
            from gem_precision.fp8_quant_triton import quantize_fp8_triton

            return quantize_fp8_triton(t, pad_to=SCALED_MM_ALIGN, **kwargs)
        return quantize_fp8_reference(t, **kwargs)

    @property
    def takes_prequantized_rows(self) -> bool:
        """Row scales only, and only when the scheme asks for it (``fp8_rowwise``'s ``producer_quantization``)."""
        return self.granularity == "row" and self.producer_rows

    @property
    def high_precision_weight_grad(self) -> bool:
        """As the scheme asks (``fp8_rowwise``'s ``weight_gradient: bf16`` or ``fp8_blocks``)."""
        return self._high_precision_weight_grad

    @property
    def block_scaled_weight_grad(self) -> bool:
        """As the scheme asks (``fp8_rowwise``'s ``weight_gradient: fp8_blocks``)."""
        return self._block_scaled_weight_grad

    @property
    def grad_rows_in_rule(self) -> bool:
        """Row scales and e4m3 gradients (``fp8_rowwise``'s default ``grad_format``)."""
        return self.granularity == "row" and self.grad_format == E4M3

    def quantize_prequantized(self, t: torch.Tensor, rows: PrequantizedRows, *, cols_t: bool) -> Quantized:
        if not self.takes_prequantized_rows:
            return super().quantize_prequantized(t, rows, cols_t=cols_t)
        row_op = Fp8Operand(rows.data, rows.scale_inv.view(-1, 1))
        if not cols_t:
            return Quantized(row_op, None)
        # the cast pass alone when the producer wrote the column maxima too; else the stats pass for them
        pair = self._quantize(
            t, granularity="row", fmt=E4M3, rows=False, cols_t=True, col_amax_bits=rows.column_amax_bits
        )
        return Quantized(row_op, pair.cols_t)

    def mm(
        self, a: Fp8Operand, b: Fp8Operand, *, out_dtype: torch.dtype, role: GemmRole, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if not self.native:
            out = a.dequantize() @ b.dequantize().t()
            return (out if bias is None else out + bias).to(out_dtype)
        rowwise = self.granularity == "row"
        # Row-wise scaling in torch._scaled_mm (CUTLASS) only writes bfloat16; tensor-wise also float32.
        mm_dtype = out_dtype if (not rowwise and out_dtype in (torch.float32, torch.bfloat16)) else torch.bfloat16
        fuse_bias = bias is not None and mm_dtype == torch.bfloat16
        out = torch._scaled_mm(
            a.data,
            b.data.t(),
            scale_a=a.scale_inv,
            scale_b=b.scale_inv.view(1, -1) if rowwise else b.scale_inv,
            bias=bias.to(torch.bfloat16) if fuse_bias and bias is not None else None,
            out_dtype=mm_dtype,
            # fast accumulation only where errors do not reach gradients (torchao's choice too)
            use_fast_accum=self.fast_accum_forward and role == "forward",
        )
        if bias is not None and not fuse_bias:
            out = out + bias
        return out.to(out_dtype)

    def shape_problem(self, in_features: int, out_features: int) -> str | None:
        if self.native and (in_features % SCALED_MM_ALIGN or out_features % SCALED_MM_ALIGN):
            return (
                f"torch._scaled_mm needs in_features and out_features divisible by {SCALED_MM_ALIGN}, "
                f"got {in_features} and {out_features}"
            )
        return None


class MXRecipe(LinearRecipe):
    """MXFP8: e4m3 elements with one e8m0 scale per 32 along each GEMM's reduction dim, for inputs,
    weights and gradients alike (the block scale tracks the range, so e5m2 is not needed).

    ``gemm``: ``triton`` (:func:`gem_precision.mx_gemm.mx_gemm_triton`), ``native`` (cuBLAS block
    scaling; a GEMM whose shape cuBLAS refuses raises, unless ``native_or_triton`` which then runs
    the Triton kernel) or ``emulated`` (dequantize + float32 mm). ``triton_quant``: Triton
    quantization kernels instead of the torch reference (same bits).
    """

    operand_type = MXTensor

    def __init__(
        self, scheme: str, *, gemm: Literal["triton", "native", "native_or_triton", "emulated"], triton_quant: bool
    ):
        self.scheme = scheme
        self.gemm = gemm
        self.backend = gemm
        self.triton_quant = triton_quant

    def quantize(self, t: torch.Tensor, *, role: Role, rows: bool, cols_t: bool, col_sum: bool = False) -> Quantized:
        row_op = col_op = None
        if self.triton_quant and (rows or cols_t):
            from gem_precision.mx_triton import mx_quantize_triton

            row_op, col_op = mx_quantize_triton(t, rows=rows, cols_t=cols_t)
        else:
            row_op = mx_quantize(t) if rows else None
            col_op = mx_quantize(t, axis=0) if cols_t else None
        return Quantized(row_op, col_op, t.float().sum(dim=0) if col_sum else None)

    def mm(
        self, a: MXTensor, b: MXTensor, *, out_dtype: torch.dtype, role: GemmRole, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.gemm == "emulated":
            out = mx_dequantize(a) @ mx_dequantize(b).t()
            return (out if bias is None else out + bias).to(out_dtype)
        from gem_precision import mx_gemm

        if self.gemm in ("native", "native_or_triton"):
            problem = mx_gemm.native_mx_shape_problem(a.shape[0], b.shape[0], a.shape[1])
            if problem is None:
                return mx_gemm.mx_gemm_native(a, b, out_dtype=out_dtype, bias=bias)
            if self.gemm == "native":
                raise ValueError(
                    f"{self.scheme} backend 'native': cuBLAS block-scaled GEMM ({role}) cannot take "
                    f"a {tuple(a.shape)} x {tuple(b.shape)}.T product: {problem}; use backend 'auto' or 'triton'"
                )
        return mx_gemm.mx_gemm_triton(a, b, out_dtype=out_dtype, bias=bias)
