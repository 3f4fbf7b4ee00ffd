"""Fused ``(layer_norm(x) * weight + bias) * u`` in Triton, forward and backward (imports triton).

Forward: one pass over ``x`` and ``u``, writes ``y`` plus per-row mean and 1/std (8 bytes a row) so
that the backward needs no second reduction over ``x`` (and, when asked, the e4m3 rows of ``y`` for
the linear that reads it: :mod:`gem_kernels.quantized_rows_triton`). Backward: one pass over ``x, u,
dy`` writing ``dx, du``; ``dweight``/``dbias`` are summed per program in fp32 and the few per-program partial rows
are added by torch at the end (no atomics, deterministic). Both loop over row tiles with their loads
issued ``PIPELINE_STAGES`` tiles ahead of the math.

With ``silu_gate`` the gate is ``silu(u)`` of a pre-activation ``u``, computed on the fly, and the
backward writes the gradient of that pre-activation (``du * silu'(u)``): the fused HSTU gap
(:mod:`gem_kernels.hstu_gap_triton`) then never materialises ``silu(u)`` nor its gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard, num_programs, silu_grad
from gem_kernels.quantized_rows_triton import RowsOut, as_words, load_e4m3_pairs, tiles_per_program, write_e4m3_rows


def _rows_per_tile(block_d: int) -> int:
    return max(1, min(64, 4096 // block_d))


PIPELINE_STAGES = 3
"""Tiles a program's loads run ahead of its math (``tl.range(..., num_stages=...)``: cp.async into shared
memory), forward and backward. Measured on the H200 at 200,000 x 1,024 (``benchmarks/pointwise_tiles.py``,
2026-12-04, 15 rotated rounds): the backward 0.765 -> 0.572 ms (1.34x, 2.7 -> 3.6 TB/s by the bytes it
must move; 4 rows, 4 warps, 2 programs per SM), the forward 0.373 -> 0.318 ms (1.17x; 4 tiles of 4 rows
a program, 4 warps). Without it, the backward's programs of 254 registers (two per SM) each waited for
their loads before every tile's math. The forward with e4m3 rows gained nothing from more tiles: it
keeps one tile a program."""
FORWARD_TILES = 4
"""Row tiles a forward program covers when it writes no column maxima (the pipeline needs a loop)."""
BACKWARD_PROGRAMS_PER_SM = 2
E4M3_WORD_STORES = True
"""The forward writes its e4m3 rows (of ``y`` for ``fp8_rowwise``, of ``x`` for ``fp8_saved``) as 16-bit
words, which keep the tile's register layout and so ``y``'s bits (``write_e4m3_rows``); False as bytes.
On the H200 (2026-12-04, 200,000 x 1,024) the forward with ``y``'s rows ran in 0.414 ms as words against
0.470 as bytes; with ``x``'s rows 0.482 against 0.461; ``y`` equals the plain forward's bit for bit."""


@triton.jit
def _norm_gate_fwd(X, U, W, B, Y, MEAN, RSTD, Q, Q_INV, COL_AMAX, XQ, XQ_INV, stride_x, stride_u, stride_y, num_rows,
                   eps, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr,
                   INTERP: tl.constexpr, SILU_GATE: tl.constexpr, QUANT: tl.constexpr, COLUMN_AMAX: tl.constexpr,
                   KEEP_X: tl.constexpr = False, WORDS: tl.constexpr = False, STAGES: tl.constexpr = None):
    cols = tl.arange(0, BLOCK_D)
    cols_ok = cols < D
    w = tl.load(W + cols, mask=cols_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cols_ok, other=0.0).to(tl.float32)
    col_max = tl.zeros([BLOCK_D], dtype=tl.int32)
    for tile in tl.range(0, TILES, num_stages=STAGES):
        rows = ((tl.program_id(0) * TILES + tile) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        rows_ok = rows < num_rows
        inside = rows_ok[:, None] & cols_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        if KEEP_X:  # x's e4m3 rows, which the backward reads in place of x (a saved format)
            write_e4m3_rows(x, rows, cols, rows_ok, cols_ok, XQ, XQ_INV, D, WORDS, ROWS, BLOCK_D)
        if SILU_GATE:
            u = u * tl.sigmoid(u)
        mean = tl.sum(x, 1) / D
        centered = tl.where(inside, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 1) / D + eps)
        y = cast((centered * rstd[:, None] * w[None, :] + b[None, :]) * u, Y.dtype.element_ty, INTERP)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=inside)
        tl.store(MEAN + rows, mean, mask=rows_ok)
        tl.store(RSTD + rows, rstd, mask=rows_ok)
        if QUANT:  # the e4m3 rows of y as written, for the linear that reads it
            col_max = tl.maximum(col_max, write_e4m3_rows(y.to(tl.float32), rows, cols, rows_ok, cols_ok, Q, Q_INV, D,
                                                          WORDS, ROWS, BLOCK_D))
    if COLUMN_AMAX:
        tl.atomic_max(COL_AMAX + cols, col_max, mask=cols_ok, sem="relaxed")


@triton.jit
def _norm_gate_bwd(X, U, W, B, DY, MEAN, RSTD, DX, DU, DW_PART, DB_PART, X_INV, U_INV, DU_SUM_PART,
                   stride_x, stride_u, stride_dy, stride_dx, stride_du, num_rows, tiles_per_program,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, INTERP: tl.constexpr,
                   SILU_GATE: tl.constexpr, X_E4M3: tl.constexpr = False, U_E4M3: tl.constexpr = False,
                   DU_SUMS: tl.constexpr = False, STAGES: tl.constexpr = None):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cols_ok = cols < D
    w = tl.load(W + cols, mask=cols_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=cols_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    db = tl.zeros([BLOCK_D], dtype=tl.float32)
    dus = tl.zeros([BLOCK_D], dtype=tl.float32)
    for t in tl.range(0, tiles_per_program, num_stages=STAGES):
        rows = ((pid * tiles_per_program + t) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        rows_ok = rows < num_rows
        inside = rows_ok[:, None] & cols_ok[None, :]
        if X_E4M3:  # e4m3 rows (stride in 16-bit words), each times its X_INV
            x = load_e4m3_pairs(X, X_INV, rows, rows_ok, stride_x, D, BLOCK_D, ROWS)
        else:
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        if U_E4M3:
            u = load_e4m3_pairs(U, U_INV, rows, rows_ok, stride_u, D, BLOCK_D, ROWS)
        else:
            u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + rows, mask=rows_ok, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rows_ok, other=0.0)
        xhat = tl.where(inside, (x - mean[:, None]) * rstd[:, None], 0.0)
        du = dy * (xhat * w[None, :] + b[None, :])
        if SILU_GATE:
            du = du * silu_grad(u)
            u = u * tl.sigmoid(u)
        dz = dy * u
        dw += tl.sum(dz * xhat, 0)
        db += tl.sum(dz, 0)
        g = dz * w[None, :]
        dx = (g - tl.sum(g, 1)[:, None] / D - xhat * (tl.sum(g * xhat, 1) / D)[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], cast(dx, DX.dtype.element_ty, INTERP), mask=inside)
        tl.store(DU + rows[:, None] * stride_du + cols[None, :], cast(du, DU.dtype.element_ty, INTERP), mask=inside)
        if DU_SUMS:  # of du as stored
            dus += tl.sum(tl.where(inside, cast(du, DU.dtype.element_ty, INTERP).to(tl.float32), 0.0), 0)
    tl.store(DW_PART + pid * BLOCK_D + cols, dw)
    if DU_SUMS:
        tl.store(DU_SUM_PART + pid * BLOCK_D + cols, dus)
    tl.store(DB_PART + pid * BLOCK_D + cols, db)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


class NormGateFunction(torch.autograd.Function):
    @staticmethod
    def run_forward(
        x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
        silu_gate: bool = False, rows_out: RowsOut | None = None,
        x_rows: RowsOut | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``y`` in ``x``'s shape, and the float32 ``mean`` and ``rstd`` of each row (``silu_gate``:
        the gate is ``silu(u)``). ``rows_out``: buffers for the e4m3 rows of ``y`` that the same pass
        writes (:mod:`gem_kernels.quantized_rows_triton`). ``x_rows``: the same for the e4m3 rows of
        ``x`` itself (no column maxima), kept for backward in place of ``x`` (the
        fused gap's saved format; :func:`norm_gate_backward` reads them with ``x_scale_inv``). Stored as
        bytes (:data:`E4M3_WORD_STORES` off) the rows change the tile's register layout on a GPU, so
        ``mean`` and ``rstd`` are summed in another order and ``y`` may differ in its last bit."""
        x2, u2 = _rows(x), _rows(u)
        num_rows, dim = x2.shape
        block_d = triton.next_power_of_2(dim)
        rows = _rows_per_tile(block_d)
        quantizing = rows_out is not None or x_rows is not None
        tiles = tiles_per_program(rows, rows_out) if quantizing else FORWARD_TILES
        words = quantizing and E4M3_WORD_STORES and dim % 2 == 0
        y = torch.empty((num_rows, dim), dtype=x.dtype, device=x.device)
        mean = torch.empty(num_rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
        weight, bias = weight.contiguous(), bias.contiguous()
        if num_rows > 0:
            with device_guard(x.device):
                _norm_gate_fwd[(triton.cdiv(num_rows, rows * tiles),)](
                    x2, u2, weight, bias, y, mean, rstd,
                    *(rows_out.kernel_args(words) if rows_out is not None else (y, mean, mean)),
                    *(x_rows.kernel_args(words)[:2] if x_rows is not None else (y, mean)), x2.stride(0), u2.stride(0),
                    y.stride(0), num_rows, eps,
                    D=dim, BLOCK_D=block_d, ROWS=rows, TILES=tiles, INTERP=INTERPRET,
                    num_warps=4 if block_d < 2048 else 8, SILU_GATE=silu_gate, QUANT=rows_out is not None,
                    COLUMN_AMAX=rows_out is not None and rows_out.column_amax_bits is not None,
                    KEEP_X=x_rows is not None, WORDS=words, STAGES=PIPELINE_STAGES,
                )  # fmt: skip
        return y.view(x.shape), mean, rstd

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        y, mean, rstd = NormGateFunction.run_forward(x, u, weight, bias, eps)
        ctx.save_for_backward(x, u, weight, bias, mean, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        dx, du, dw, db = norm_gate_backward(dy, *ctx.saved_tensors)
        return dx, du, dw, db, None


def norm_gate_backward(
    dy: torch.Tensor, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
    mean: torch.Tensor, rstd: torch.Tensor, *, silu_gate: bool = False, du_out: torch.Tensor | None = None,
    x_scale_inv: torch.Tensor | None = None, u_scale_inv: torch.Tensor | None = None,
    du_sum_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dx, du`` in ``x``'s shape (contiguous) and ``d_weight, d_bias`` of one call. ``silu_gate``: the
    forward's gate was ``silu(u)``, and ``du`` is the gradient of ``u`` itself. ``du_out``: a ``[rows,
    D]`` view (unit last stride) to write ``du`` into, instead of a new tensor. ``x_scale_inv`` /
    ``u_scale_inv``: ``x`` / ``u`` are e4m3 rows ``[rows, D]`` (``D`` and the row stride even, e.g. the
    ``u`` columns of the fused gap's saved rows), each times its scale, read by the kernel's loop as
    16-bit words (:func:`gem_kernels.quantized_rows_triton.load_e4m3_pairs`); ``dx`` and ``du`` are then
    in ``dy``'s dtype. ``du_sum_out``: a float32 ``[D]`` tensor that receives the column sums of ``du`` as
    stored (the fused gap's ``u`` columns of the ``uvqk`` bias gradient: :data:`gem_kernels.hstu_gap_triton.U_SUMS_IN_NORM_GATE`)."""
    if du_sum_out is not None and (du_sum_out.shape != (weight.shape[0],) or du_sum_out.dtype != torch.float32):
        raise ValueError(f"norm_gate_backward: du_sum_out must be float32 [{weight.shape[0]}], "
                         f"got {du_sum_out.dtype} {tuple(du_sum_out.shape)}")  # fmt: skip
    x_e4m3, u_e4m3 = x_scale_inv is not None, u_scale_inv is not None
    x2, u2, dy2 = _rows(x), _rows(u), _rows(dy)
    xk, uk = (as_words(x2) if x_e4m3 else x2), (as_words(u2) if u_e4m3 else u2)  # what the kernel reads
    weight, bias = weight.contiguous(), bias.contiguous()
    num_rows, dim = x2.shape
    block_d = triton.next_power_of_2(dim)
    rows = _rows_per_tile(block_d)
    tiles = triton.cdiv(num_rows, rows)
    programs = num_programs(x2.device, BACKWARD_PROGRAMS_PER_SM, max(tiles, 1))
    tiles_per_program = triton.cdiv(tiles, programs)
    dx = torch.empty((num_rows, dim), dtype=dy.dtype if x_e4m3 else x.dtype, device=x.device)
    du = torch.empty((num_rows, dim), dtype=dy.dtype if u_e4m3 else u.dtype, device=u.device) if du_out is None else du_out
    dw_part = torch.empty((programs, block_d), dtype=torch.float32, device=x2.device)
    db_part = torch.empty((programs, block_d), dtype=torch.float32, device=x2.device)
    du_sum_part = db_part if du_sum_out is None else torch.empty_like(db_part)
    with device_guard(x2.device):
        _norm_gate_bwd[(programs,)](
            xk, uk, weight, bias, dy2, mean, rstd, dx, du, dw_part, db_part,
            x_scale_inv if x_e4m3 else mean, u_scale_inv if u_e4m3 else mean, du_sum_part, xk.stride(0),
            uk.stride(0), dy2.stride(0), dx.stride(0), du.stride(0), num_rows, tiles_per_program,
            D=dim, BLOCK_D=block_d, ROWS=rows, INTERP=INTERPRET, num_warps=4 if block_d < 2048 else 8,
            SILU_GATE=silu_gate, X_E4M3=x_e4m3, U_E4M3=u_e4m3, DU_SUMS=du_sum_out is not None,
            STAGES=PIPELINE_STAGES,
        )
    if du_sum_out is not None:
        torch.sum(du_sum_part[:, :dim], 0, out=du_sum_out)
    dw = dw_part[:, :dim].sum(0).to(weight.dtype)
    db = db_part[:, :dim].sum(0).to(bias.dtype)
    return dx.view(x.shape), (du if du_out is not None else du.view(u.shape)), dw, db


def norm_gate_triton(
    x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """Differentiable fused ``(layer_norm(x) * weight + bias) * u`` over the last dim. Eager only: under
    ``torch.compile`` call the custom op :func:`gem_kernels.compiled_ops.norm_gate_op` instead (the
    registered ``triton`` kernel does so)."""
    return NormGateFunction.apply(x, u, weight, bias, eps)
