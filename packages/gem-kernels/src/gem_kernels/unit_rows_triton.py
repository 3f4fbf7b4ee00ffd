"""The next-item loss's shared negatives normalised to unit rows, and the gradient back through it, in
one Triton pass each (imports triton).

Under ``l2_normalize`` the loss kernels read ``u(n) = n / max(|n|, eps)`` of every negative, in the query's
dtype, and write the gradient of ``u``. In torch (``gem_model.api.unit_rows`` and ``unit_rows_vjp``) that
is seven float32 passes over the ``[B K, D]`` negatives each step (the cast up, the norm, the division,
the cast down; in backward the cast and norm again, then a product, a row sum, a subtraction and a
division): 1.6-1.9 ms a step on the H100's big config (384 x 128 negatives of 1,024; 2026-12-05 profile),
for 100 MB of bf16 rows. Here the forward reads each row once and writes ``u`` and ``|n|``; the backward
reads the row, its norm and ``u``'s gradient and writes the negatives' gradient in their dtype.

The math is ``unit_rows``'s, in float32: ``u = n / max(|n|, eps)``, and for the gradient ``g`` of ``u``,
``(g - u (u . g) [|n| >= eps]) / max(|n|, eps)``. Only the order of the row sums differs from torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard
from gem_kernels.row_blocks import MAX_DIM, rows_per_program
from gem_model.api import L2_EPS


def _launch(dim: int) -> tuple[int, int]:
    """``(BLOCK_D, rows per program)``, as the layer norm's forward."""
    block_d = triton.next_power_of_2(dim)
    return block_d, rows_per_program(block_d)


@triton.jit
def _row_block(X, stride_x, num_rows, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr):
    """This program's rows, its columns, which rows and elements exist, and ``X``'s rows in float32."""
    cols = tl.arange(0, BLOCK_D)
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    rows_ok = rows < num_rows
    inside = rows_ok[:, None] & (cols < D)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    return rows, cols, rows_ok, inside, x


@triton.jit
def _unit_rows_fwd(X, U, NORM, stride_x, num_rows, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   ROWS: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    rows, cols, rows_ok, inside, x = _row_block(X, stride_x, num_rows, D, BLOCK_D, ROWS)
    norm = tl.sqrt(tl.sum(x * x, 1))
    u = x / tl.maximum(norm, eps)[:, None]
    tl.store(U + rows[:, None] * D + cols[None, :], cast(u, U.dtype.element_ty, INTERP), mask=inside)
    tl.store(NORM + rows, norm, mask=rows_ok)


@triton.jit
def _unit_rows_bwd(G, X, NORM, DX, stride_x, num_rows, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   ROWS: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    rows, cols, rows_ok, inside, x = _row_block(X, stride_x, num_rows, D, BLOCK_D, ROWS)
    g = tl.load(G + rows[:, None] * D + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    norm = tl.load(NORM + rows, mask=rows_ok, other=1.0)
    denom = tl.maximum(norm, eps)
    u = x / denom[:, None]
    along = tl.where(norm >= eps, tl.sum(u * g, 1), 0.0)
    dx = (g - u * along[:, None]) / denom[:, None]
    tl.store(DX + rows[:, None] * D + cols[None, :], cast(dx, DX.dtype.element_ty, INTERP), mask=inside)


def _rows_2d(x: torch.Tensor, name: str) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] > MAX_DIM:
        raise ValueError(f"{name}: rows [N, D] with D at most {MAX_DIM}, got {tuple(x.shape)}")
    return x if x.stride(1) == 1 else x.contiguous()


def unit_rows_triton(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(u, norm)``: the rows of ``x [N, D]`` over ``max(|x|, L2_EPS)``, contiguous in ``dtype``, and their
    float32 norms ``[N]`` (for :func:`unit_rows_vjp_triton`). Not differentiable: the caller's backward
    calls the vjp."""
    x = _rows_2d(x, "unit_rows_triton")
    rows, dim = x.shape
    u = torch.empty((rows, dim), dtype=dtype, device=x.device)
    norm = torch.empty(rows, dtype=torch.float32, device=x.device)
    block_d, per = _launch(dim)
    if rows:
        with device_guard(x.device):
            _unit_rows_fwd[(triton.cdiv(rows, per),)](x, u, norm, x.stride(0), rows, L2_EPS, D=dim, BLOCK_D=block_d,
                                                      ROWS=per, INTERP=INTERPRET, num_warps=4)  # fmt: skip
    return u, norm


def unit_rows_vjp_triton(grad: torch.Tensor, x: torch.Tensor, norm: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The gradient of ``x [N, D]`` from ``grad`` (the gradient of its unit rows, any float dtype) and
    ``norm`` (from :func:`unit_rows_triton`), in ``x``'s dtype; written into ``out`` (contiguous rows of
    ``x``'s shape and dtype) when given."""
    x = _rows_2d(x, "unit_rows_vjp_triton")
    rows, dim = x.shape
    if grad.shape != x.shape or norm.shape != (rows,) or norm.dtype != torch.float32:
        raise ValueError(f"unit_rows_vjp_triton: grad must be {tuple(x.shape)} and norm float32 [{rows}], got "
                         f"{tuple(grad.shape)} and {norm.dtype} {tuple(norm.shape)}")  # fmt: skip
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype or out.device != x.device
                            or not out.is_contiguous()):  # fmt: skip
        raise ValueError(f"unit_rows_vjp_triton: out must be contiguous {x.dtype} {tuple(x.shape)} on {x.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")  # fmt: skip
    grad = grad.contiguous()
    dx = out if out is not None else torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    block_d, per = _launch(dim)
    if rows:
        with device_guard(x.device):
            _unit_rows_bwd[(triton.cdiv(rows, per),)](grad, x, norm, dx, x.stride(0), rows, L2_EPS, D=dim,
                                                      BLOCK_D=block_d, ROWS=per, INTERP=INTERPRET, num_warps=4)  # fmt: skip
    return dx
