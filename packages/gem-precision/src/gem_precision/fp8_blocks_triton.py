"""The transposed operand of a weight-gradient GEMM in fp8 with 1 x 128 block scales, in one pass: the
bits of :func:`gem_precision.fp8_reference.quantize_blocks_t_reference`.

``dW = g^T x`` reduces over the tokens. ``fp8_rowwise``'s ``weight_gradient: fp8`` scales each column of
``g`` and ``x`` over all tokens, which needs the column's maximum over every row before any byte is
written (a stats pass, or column maxima from the producer, then a cast pass). With one scale per
column and block of 128 tokens (``torch``'s ``ScalingType.BlockWise1x128``, on Hopper through cuBLAS),
a program that holds 128 rows can scale, cast and transpose them at once. Each program here takes one
block of 128 rows and ``BLOCK_N`` columns: the columns' maxima over its rows, one power-of-two scale each,
the e4m3 bytes stored transposed (128 contiguous bytes a column), and the block's dequantization
factors (one row of the ``[M_pad / 128, N]`` scale array).

``benchmarks/weight_grad_blockwise.py`` times it and the GEMM it feeds against the bf16 weight gradient.
``fp8_rowwise``'s ``weight_gradient: fp8_blocks`` runs it in backward (:mod:`gem_precision.blockwise_weight_grad`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_precision.formats import E4M3, Fp8Format
from gem_precision.fp8_reference import Fp8Operand, round_up
from gem_precision.triton_common import (
    abs_bits,
    cast_to_fp8_bits,
    check_triton_device,
    fp8_kernel_constants,
    interpreting,
    pow2_scale,
    software_rounding_default,
)

TILE_N = 64
"""Columns a program covers on a GPU (128 x 64 bf16 in, 8 KiB of e4m3 out); the interpreter takes 16."""


@triton.jit
def _fp8_blocks_t_kernel(
    x_ptr, M, N, stride_xm, q_ptr, q_inv_ptr, M_PAD,
    BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, FP8_E5M2: tl.constexpr, EMAX: tl.constexpr,
    MBITS: tl.constexpr, MIN_NORMAL: tl.constexpr, MAGIC: tl.constexpr, SOFTWARE_ROUND: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    rows = b * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols_ok = cols < N
    mask = (rows < M)[:, None] & cols_ok[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    scale, scale_inv, bad = pow2_scale(tl.max(abs_bits(x), axis=0), EMAX)
    bits = cast_to_fp8_bits(x * scale[None, :], FP8_E5M2, MBITS, MIN_NORMAL, MAGIC, SOFTWARE_ROUND)
    bits = tl.where(bad[None, :], 127, bits.to(tl.int32)).to(tl.uint8)  # rows past M hold 0: zero bytes
    q_ptrs = q_ptr + cols[None, :].to(tl.int64) * M_PAD + rows[:, None]
    tl.store(q_ptrs, bits, mask=cols_ok[None, :])
    tl.store(q_inv_ptr + b * N + cols, scale_inv, mask=cols_ok)


def quantize_fp8_blocks_t_triton(x: torch.Tensor, fmt: Fp8Format = E4M3, *, block: int = 128,
                                 software_round: bool | None = None) -> Fp8Operand:  # fmt: skip
    """``quantize_blocks_t_reference(x, fmt, block=block)`` in one pass over ``x [M, N]`` (contiguous
    rows): ``data [N, M_pad]`` and ``scale_inv [N, M_pad / block]`` with stride ``(1, N)``."""
    check_triton_device(x, "quantize_fp8_blocks_t_triton")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_fp8_blocks_t_triton: expected 2-d with contiguous rows, got {tuple(x.shape)} "
                         f"{x.stride()}")  # fmt: skip
    if block < 16 or block & (block - 1):
        raise ValueError(f"quantize_fp8_blocks_t_triton: block must be a power of two of at least 16, got {block}")
    m, n = x.shape
    m_pad = round_up(m, block)
    q = torch.empty((n, m_pad), dtype=torch.uint8, device=x.device)
    q_inv = torch.empty((m_pad // block, n), dtype=torch.float32, device=x.device)
    block_n = 16 if interpreting() else TILE_N
    if m_pad and n:
        _fp8_blocks_t_kernel[(m_pad // block, triton.cdiv(n, block_n))](
            x, m, n, x.stride(0), q, q_inv, m_pad, BLOCK=block, BLOCK_N=block_n, **fp8_kernel_constants(fmt),
            SOFTWARE_ROUND=software_rounding_default() if software_round is None else software_round, num_warps=4,
        )  # fmt: skip
    return Fp8Operand(q.view(fmt.dtype), q_inv.t())
