"""The weight gradient of a linear as an e4m3 GEMM with 1 x 128 block scales: ``fp8_rowwise``'s option
``weight_gradient: fp8_blocks``.

``dW = g^T x`` reduces over the tokens. It is one of a linear's three GEMMs of equal size, so about a third
of an ``fp8_rowwise`` step's GEMM work; under ``weight_gradient: bf16`` it is a bfloat16 GEMM while the
forward and ``dx`` GEMMs run in fp8, the largest GEMM time left in the step
(``benchmarks/weight_grad_blockwise.py``). ``weight_gradient: fp8`` makes it an fp8 GEMM with one scale per
feature over all tokens, but each feature's maximum over every token must be known before any byte of
the transposed operands is written: a stats pass and a cast pass over ``g`` and ``x`` each, which cost
what the fp8 GEMM saves. Here each feature gets one power-of-two scale per block of 128 tokens
(DeepSeek-V3's recipe for ``dW``; torch's ``ScalingType.BlockWise1x128``, cuBLAS on Hopper): a kernel
that holds 128 rows scales, casts and transposes them in one pass
(:func:`gem_precision.fp8_blocks_triton.quantize_fp8_blocks_t_triton`).

Both operands are made in backward, from the unquantized bf16 ``g`` and the bf16 ``x`` the forward saved,
as under ``weight_gradient: bf16`` (:attr:`gem_precision.recipes.LinearRecipe.high_precision_weight_grad`).
``g`` exists only in backward anyway, and making ``x``'s operand there too leaves the forward exactly as
under ``bf16``: no transposed operand, no extra pass, ``x`` saved as given; the forward and ``dx`` GEMMs,
the rows the producers write and the gradient rows they offer are unchanged. The price is a pass over
each of ``g`` and ``x`` in backward (the producers could write these bytes in their own passes instead).

Backends, as the recipe's: ``native``: the Triton pass for each operand and ``torch._scaled_mm`` with
the block scales (float32 out; the form ``benchmarks/weight_grad_blockwise.py`` checked on Hopper);
emulated: :func:`gem_precision.fp8_reference.quantize_blocks_t_reference` (the same bits), each operand
dequantized to float32 and multiplied in float32.
"""

from __future__ import annotations

import torch

from gem_precision.formats import E4M3
from gem_precision.fp8_reference import Fp8Operand, quantize_blocks_t_reference

BLOCK = 128
"""Tokens per scale: the block of ``ScalingType.BlockWise1x128``."""


def block_scaled_operands(g2d: torch.Tensor, x2d: torch.Tensor, *, native: bool) -> tuple[Fp8Operand, Fp8Operand]:
    """``g [T, out]`` and ``x [T, in]`` (contiguous rows) transposed and quantized in e4m3 with one
    power-of-two scale per feature and block of 128 tokens: ``data [features, T_pad]`` (``T`` rounded up
    to 128, zeros past ``T``) and ``scale_inv [features, T_pad / 128]`` with stride ``(1, features)``.
    ``native``: the one-pass Triton kernel; else the torch reference (the same bits)."""
    if native:
        from gem_precision.fp8_blocks_triton import quantize_fp8_blocks_t_triton as quantize
    else:
        quantize = quantize_blocks_t_reference
    return quantize(g2d, E4M3, block=BLOCK), quantize(x2d, E4M3, block=BLOCK)


def dequantize_blocks(op: Fp8Operand) -> torch.Tensor:
    """``[features, T_pad]`` float32: each byte times its feature's factor for its block of tokens (exact:
    an e4m3 value times a power of two)."""
    return op.data.float() * op.scale_inv.repeat_interleave(BLOCK, dim=1)


def block_scaled_mm(gq: Fp8Operand, xq: Fp8Operand, *, native: bool) -> torch.Tensor:
    """``gq @ xq^T`` as float32 ``[out, in]``: ``torch._scaled_mm`` with 1 x 128 scales on both operands
    (``a`` row-major, ``b`` a column-major view, ``scale_a [out, T_pad / 128]`` as made, ``scale_b
    [T_pad / 128, in]`` row-major), or, not ``native``, the float32 product of the dequantized operands."""
    if native:
        return torch._scaled_mm(gq.data, xq.data.t(), gq.scale_inv, xq.scale_inv.t(), out_dtype=torch.float32)
    return dequantize_blocks(gq) @ dequantize_blocks(xq).t()


def block_scaled_weight_grad(g2d: torch.Tensor, x2d: torch.Tensor, *, native: bool) -> torch.Tensor:
    """``dW = g^T x`` as float32 ``[out, in]`` from the unquantized gradient ``g2d [T, out]`` and the
    input ``x2d [T, in]`` the forward saved: both quantized here (see :func:`block_scaled_operands`), then
    :func:`block_scaled_mm`. A non-finite value makes its block's factor NaN (:mod:`gem_precision.fp8_reference`),
    so the row (a feature of ``g``) or column (of ``x``) of ``dW`` it falls in comes out NaN."""
    gq, xq = block_scaled_operands(g2d, x2d, native=native)
    return block_scaled_mm(gq, xq, native=native)
