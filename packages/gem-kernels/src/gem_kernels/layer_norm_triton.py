"""The HSTU block's input layer norm and its residual branch in Triton, as one autograd function
(imports triton).

A block computes ``x + f(layer_norm(x))``: ``x`` has two uses, so autograd adds their two gradients in
a pass of its own after the layer norm's backward (read two, write one). :class:`NormFork` returns
``(layer_norm(x), x)`` and the block adds ``f(...)`` to that second output: both gradients then reach
one backward, whose kernel adds the residual's gradient while it writes the layer norm's. Forward: one
pass writing the normalised rows plus each row's mean and 1/std (fp32), and when the linear that reads
them asks for it, their e4m3 copy (``gem_model.api.RowQuantization``); backward: one pass over ``x``
and both gradients. No affine parameters (the block's layer norm has none).

The gradient the backward writes is the gradient of ``x``, the previous block's output, which that
block's residual add hands on unchanged to its output projection. Given that linear's slot
(``gem_model.api.GradRowsSlot``, found on ``x`` by ``attached_grad_rows``), the backward also writes
the gradient's e4m3 rows and offers them, and the linear quantizes nothing. When the slot asks for the
gradient's column sums alone (the linear's bias gradient: a ``bf16`` linear's slot), the pass sums the
gradient as it stores it: each program walks :data:`SUM_TILES` tiles of rows, pipelined, and writes one
float32 partial row, which torch sums (``[rows / 64, D]``: 3 % of the gradient's bytes at the big
config). So the linear reads its output gradient once less. A slot that asks for the e4m3 rows as well
(``fp8_rowwise``'s) is offered the rows alone, and its linear sums: with the rows the walk is slower than
the sum after it (:data:`COLUMN_SUMS`; a first try, 2026-12-03, walked 128 rows a program unpipelined
with the rows: 9.3 ms a step on the H200's big config against 2.9 ms without rows).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard
from gem_kernels.quantized_rows_triton import RowsOut, tiles_per_program, write_e4m3_rows
from gem_kernels.row_blocks import MAX_DIM, rows_per_program
from gem_model.api import GradRowsSlot, PrequantizedRows, RowQuantization

COLUMN_SUMS = True
"""Whether the backward sums the gradient's columns when a slot asks for them alone (read at call time; else
the linear sums its output gradient itself). On the H100 (2026-12-06, ``benchmarks/reduction_passes.py`` at
207,000 x 1,024) the pass with its sums took 0.583 ms (8 or 16 tiles a program; 0.601 at 4, 0.592 at 32)
against 0.689 for the pass and the linear's ``column_sums``; the step 1.006x / 1.003x on two seeds. On since
then (e2e switch ``bias_sums_in_linear`` turns it off). Beside the e4m3 rows (``fp8_rowwise``'s slots) the
sums are not taken: that pass ran 1.231 ms against 0.784 for the rows alone and torch's sum after it."""
SUM_TILES = 16
"""Tiles of rows (4 rows each at D = 1024) a program of the backward walks when it also sums the gradient's
columns: fewer programs write fewer float32 partial rows, longer walks hide less of each tile's latency
(on the H100 8 and 16 tiles took 0.583 / 0.584 ms at 207,000 x 1,024, 4 tiles 0.601, 32 tiles 0.592)."""
SUM_STAGES = 2
"""Tiles whose loads run ahead in that walk (``tl.range(..., num_stages=...)``)."""


@triton.jit
def _norm_fwd(X, Y, MEAN, RSTD, Q, Q_INV, COL_AMAX, stride_x, stride_y, num_rows, eps,
              D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr,
              QUANT: tl.constexpr, COLUMN_AMAX: tl.constexpr, INTERP: tl.constexpr,
              STAGES: tl.constexpr = None):  # fmt: skip
    cols = tl.arange(0, BLOCK_D)
    cols_ok = cols < D
    col_max = tl.zeros([BLOCK_D], dtype=tl.int32)
    for tile in tl.range(0, TILES, num_stages=STAGES):
        rows = ((tl.program_id(0) * TILES + tile) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        rows_ok = rows < num_rows
        inside = rows_ok[:, None] & cols_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        mean = tl.sum(x, 1) / D
        centered = tl.where(inside, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 1) / D + eps)
        y = cast(centered * rstd[:, None], Y.dtype.element_ty, INTERP)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=inside)
        tl.store(MEAN + rows, mean, mask=rows_ok)
        tl.store(RSTD + rows, rstd, mask=rows_ok)
        if QUANT:  # the e4m3 rows of y as written, for the linear that reads it
            col_max = tl.maximum(col_max, write_e4m3_rows(y.to(tl.float32), rows, cols, rows_ok, cols_ok, Q, Q_INV, D))
    if COLUMN_AMAX:
        tl.atomic_max(COL_AMAX + cols, col_max, mask=cols_ok, sem="relaxed")


@triton.jit
def _norm_bwd(X, DY, DSKIP, DX, MEAN, RSTD, Q, Q_INV, SUMS, stride_x, stride_dy, stride_skip, stride_dx, num_rows,
              D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr,
              HAS_SKIP: tl.constexpr, XHAT_GIVEN: tl.constexpr, QUANT: tl.constexpr, COL_SUM: tl.constexpr,
              INTERP: tl.constexpr, STAGES: tl.constexpr = None):  # fmt: skip
    """``XHAT_GIVEN``: ``X`` is the forward's output (the normalised rows) rather than its input; ``MEAN``
    is then unused. ``QUANT``: also the e4m3 rows of ``DX`` as stored, into ``Q``/``Q_INV``. ``COL_SUM``:
    the float32 column sums of ``DX`` as stored over this program's ``TILES`` tiles, into ``SUMS[program]``."""
    cols = tl.arange(0, BLOCK_D)
    cols_ok = cols < D
    sums = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile in tl.range(0, TILES, num_stages=STAGES):
        rows = ((tl.program_id(0) * TILES + tile) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        rows_ok = rows < num_rows
        inside = rows_ok[:, None] & cols_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        g = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rows_ok, other=0.0)
        if XHAT_GIVEN:
            xhat = x
        else:
            mean = tl.load(MEAN + rows, mask=rows_ok, other=0.0)
            xhat = tl.where(inside, (x - mean[:, None]) * rstd[:, None], 0.0)
        dx = (g - tl.sum(g, 1)[:, None] / D - xhat * (tl.sum(g * xhat, 1) / D)[:, None]) * rstd[:, None]
        if HAS_SKIP:
            dx += tl.load(DSKIP + rows[:, None] * stride_skip + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        stored = cast(dx, DX.dtype.element_ty, INTERP)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], stored, mask=inside)
        if QUANT:  # the e4m3 rows of the gradient as stored, for the linear whose output it is the gradient of
            write_e4m3_rows(stored.to(tl.float32), rows, cols, rows_ok, cols_ok, Q, Q_INV, D)
        if COL_SUM:  # that linear's bias gradient
            sums += tl.sum(tl.where(inside, stored.to(tl.float32), 0.0), 0)
    if COL_SUM:
        tl.store(SUMS + tl.program_id(0).to(tl.int64) * D + cols, sums, mask=cols_ok)


def _launch_shape(dim: int, backward: bool = False, e4m3_rows: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_D, rows per program, warps)``; ``e4m3_rows``: a forward that writes e4m3 rows without
    column maxima (``fp8_rowwise``'s producer)."""
    block_d = triton.next_power_of_2(dim)
    # the backward holds three rows' worth of tiles (x, dy, the residual's gradient): half the forward's
    # rows per program ran 1.23x faster at 200k x 1024 on the H200, 0.408 against 0.503 ms
    # (benchmarks/pointwise_tiles.py, 2026-12-02)
    rows = max(1, rows_per_program(block_d) // 2) if backward else rows_per_program(block_d)
    if e4m3_rows and not backward:
        # the e4m3 rows' second reduction (the row maximum) and their stores: a quarter of the rows per
        # program ran 1.13x faster at 219,000 x 1024 on the H200, 0.330 against 0.373 ms
        # (benchmarks/pointwise_tiles.py --kernels norm_fwd_e4m3, 2026-12-04)
        rows = max(1, rows // 4)
    return block_d, rows, 4 if block_d <= 2048 else 8


class NormFork(torch.autograd.Function):
    """``(layer_norm(x), x)`` over the last dim, no affine; the backward sums both outputs' gradients.
    With a ``RowQuantization``, also the e4m3 rows of ``layer_norm(x)``, its scales and column maxima
    (None when not asked for), not differentiable."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, eps: float, quantize: RowQuantization | None, keep_output: bool = False,
        grad_rows: GradRowsSlot | None = None,
    ) -> tuple[torch.Tensor | None, ...]:  # fmt: skip
        x2 = x.reshape(-1, x.shape[-1])
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        rows, dim = x2.shape
        y = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        q = RowsOut.allocate(rows, dim, x.device, quantize) if quantize is not None else None
        block_d, per, warps = _launch_shape(dim, e4m3_rows=q is not None and q.column_amax_bits is None)
        tiles = tiles_per_program(per, q)
        if rows:
            with device_guard(x.device):
                _norm_fwd[(triton.cdiv(rows, per * tiles),)](
                    x2, y, mean, rstd, *(q.kernel_args() if q is not None else (y, mean, mean)),
                    x2.stride(0), y.stride(0), rows, eps, D=dim, BLOCK_D=block_d, ROWS=per, TILES=tiles,
                    QUANT=q is not None, COLUMN_AMAX=q is not None and q.column_amax_bits is not None,
                    INTERP=INTERPRET, num_warps=warps,
                )  # fmt: skip
        # keep_output: the backward reads the normalised rows (which the linear after it keeps anyway)
        # instead of x, so x is freed after the forward: 2 bytes a value less, xhat rounded to y's dtype
        ctx.save_for_backward(*((y, mean, rstd) if keep_output else (x2, mean, rstd)))
        ctx.keep_output, ctx.grad_rows = keep_output, grad_rows
        ctx.shape, ctx.dtype = x.shape, x.dtype
        # the second output is x itself (a view): the block's residual branch, whose gradient
        # arrives here beside the layer norm's
        if q is None:
            return y.view(x.shape), x.view_as(x)
        ctx.mark_non_differentiable(*q.tensors())
        ctx.set_materialize_grads(False)  # no zero gradients made up for the quantized rows
        return y.view(x.shape), x.view_as(x), q.data, q.scale_inv, q.column_amax_bits

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dy: torch.Tensor | None, dskip: torch.Tensor | None, *_rows: None
    ) -> tuple[torch.Tensor | None, ...]:
        x2, mean, rstd = ctx.saved_tensors
        rows, dim = x2.shape
        if dy is None:
            return dskip, None, None, None, None
        skip = None if dskip is None else dskip.reshape(rows, dim)
        slot: GradRowsSlot | None = ctx.grad_rows
        want_rows = slot is not None and slot.rows
        want_sums = slot is not None and slot.column_sum and not slot.rows and COLUMN_SUMS  # beside rows: slower
        dx, q, sums = norm_backward(x2, dy.reshape(rows, dim), skip, mean, rstd, xhat_given=ctx.keep_output,
                                    rows_out=want_rows, col_sum=want_sums)  # fmt: skip
        if slot is not None and (want_rows or want_sums):
            slot.offer(dx, None if q is None else q.result(), sums)
        return dx.view(ctx.shape), None, None, None, None


def norm_backward(x: torch.Tensor, dy: torch.Tensor, dskip: torch.Tensor | None, mean: torch.Tensor,
                  rstd: torch.Tensor, *, xhat_given: bool = False, rows_out: bool = False, col_sum: bool = False,
                  sum_tiles: int | None = None) -> tuple[torch.Tensor, RowsOut | None, torch.Tensor | None]:  # fmt: skip
    """The layer norm's backward pass over ``[rows, D]``: ``dx`` (in ``x``'s dtype; plus ``dskip``, the
    residual's gradient, when given) from the forward's input ``x`` (or, ``xhat_given``, its output) and
    its per-row ``mean`` and ``rstd``. ``rows_out``: also ``dx``'s e4m3 rows as stored
    (:class:`~gem_model.api.RowQuantization`'s rule); ``col_sum``: also ``dx``'s float32 column sums as
    stored, from ``sum_tiles`` tiles a program (:data:`SUM_TILES` if None). Returns ``(dx, rows or None,
    sums or None)``."""
    rows, dim = x.shape

    def rows_of(t: torch.Tensor) -> torch.Tensor:
        return t if t.stride(-1) == 1 else t.contiguous()

    dy, skip = rows_of(dy), None if dskip is None else rows_of(dskip)
    dx = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    block_d, per, warps = _launch_shape(dim, backward=True)
    q = RowsOut.allocate(rows, dim, x.device, RowQuantization()) if rows_out else None
    tiles = (SUM_TILES if sum_tiles is None else sum_tiles) if col_sum else 1
    programs = triton.cdiv(rows, per * tiles)
    partials = torch.empty((programs, dim), dtype=torch.float32, device=x.device) if col_sum else None
    if rows:
        with device_guard(x.device):
            _norm_bwd[(programs,)](
                x, dy, skip if skip is not None else dy, dx, mean, rstd,
                *((q.data, q.scale_inv) if q is not None else (dx, mean)), partials if col_sum else mean,
                x.stride(0), dy.stride(0), (skip if skip is not None else dy).stride(0), dx.stride(0), rows,
                D=dim, BLOCK_D=block_d, ROWS=per, TILES=tiles, HAS_SKIP=skip is not None, XHAT_GIVEN=xhat_given,
                QUANT=q is not None, COL_SUM=col_sum, INTERP=INTERPRET, num_warps=warps,
                STAGES=SUM_STAGES if col_sum else None,
            )  # fmt: skip
    sums = None
    if partials is not None:
        sums = partials.sum(0) if rows else torch.zeros(dim, dtype=torch.float32, device=x.device)
    return dx, q, sums


def norm_fork(
    x: torch.Tensor, eps: float = 1e-5, *, quantize: RowQuantization | None = None, keep_output: bool = False,
    grad_rows: GradRowsSlot | None = None,
) -> tuple[torch.Tensor, torch.Tensor, PrequantizedRows | None]:  # fmt: skip
    """``(layer_norm(x), x, rows)``, differentiable, with one fused backward for both (see the module
    docstring). ``eps`` is ``F.layer_norm``'s default. ``rows``: with ``quantize``, ``layer_norm(x)``
    quantized as it says (:mod:`gem_kernels.quantized_rows_triton`), written by the same pass; else None.
    ``keep_output``: the backward reads ``layer_norm(x)`` (rounded to ``x``'s dtype) instead of ``x``, so
    that ``x`` need not be kept when the next op keeps ``layer_norm(x)`` anyway (the fused block under a
    saved-activation format). ``grad_rows``: the slot of the linear whose output gets ``x``'s gradient
    unchanged (``gem_model.api.attached_grad_rows(x)``), offered that gradient's e4m3 rows by the
    backward's pass."""
    if x.shape[-1] > MAX_DIM:
        raise ValueError(f"norm_fork: rows of at most {MAX_DIM} elements, got {x.shape[-1]}")
    if grad_rows is not None and not isinstance(grad_rows, GradRowsSlot):
        raise TypeError(f"norm_fork: grad_rows must be a gem_model.api.GradRowsSlot, got {type(grad_rows).__name__}")
    if quantize is None:
        ln, skip = NormFork.apply(x, eps, None, keep_output, grad_rows)
        return ln, skip, None
    ln, skip, data, scale_inv, column_amax = NormFork.apply(x, eps, quantize, keep_output, grad_rows)
    return ln, skip, RowsOut(data, scale_inv, column_amax).result()
