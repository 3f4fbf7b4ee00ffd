"""The sequence tower's last step in Triton (imports triton): the final layer norm of every row, each
sequence's history rows and last row taken out, and the mean of each history.

In torch (``gem_model.model.gem`` ``encode()`` after ``self.seq_norm``) this is a layer norm, a gather of
the history rows and of the last rows (``jagged.split_rows``) and the means as a GEMM with the ``[B, N]``
membership matrix (``jagged.segment_mean``); in backward, the GEMM's transpose, a scatter of the two
gradients into one and the layer norm's backward: about 4 ms of a 200 ms step on the H100's big config
(384 sequences, ~208,000 rows of 1,024 bf16). Here the forward reads each row once and writes it once
where it goes (history, last, or both) with its mean and 1/std, and each program keeps the float32
column sums of its history rows; a second small kernel adds each sequence's sums in a fixed order. The
backward reads each row, its statistics and its gradient once, writes x's gradient, and each program
keeps float32 column sums for the weight and bias gradients, which torch adds in a fixed order. No
atomics: the results are the same from run to run.

The math is :func:`sequence_pool_reference`'s: the layer norm in float32, the means of the rows as
rounded to x's dtype (as ``segment_mean`` sees them), summed in float32. Only the sums' order differs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard
from gem_kernels.row_blocks import MAX_DIM, rows_per_program

CHUNK = 128
"""Rows of one sequence a forward program takes (read at call time: tests set it small)."""

BACKWARD_ROWS = 128
"""Rows of x a backward program takes (in blocks held in registers): ``N / 128`` programs' column sums
of ``[D]`` float32 each for the weight and bias gradients (read at call time)."""

MEAN_COLUMNS = 256
"""Columns of the means one program of the second forward kernel adds up."""


@triton.jit
def _pool_fwd(X, W, BIAS, OFFSETS, HIST, LAST, ROW_MEAN, ROW_RSTD, PARTIAL, stride_x, n_chunks, eps,
              D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, CHUNK_ROWS: tl.constexpr,
              LEAD: tl.constexpr, TAIL: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """Program ``(b, c)``: rows ``c * CHUNK_ROWS ...`` of sequence ``b``, and their history's column sums."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    start = tl.load(OFFSETS + b)
    seq_len = tl.load(OFFSETS + b + 1) - start
    first = c * CHUNK_ROWS
    if first < seq_len:
        hist_len = seq_len - TAIL
        hist_start = start - b * TAIL  # the exclusive cumsum of the history lengths
        cols = tl.arange(0, BLOCK_D)
        cols_ok = cols < D
        w = tl.load(W + cols, mask=cols_ok, other=0.0).to(tl.float32)
        shift = tl.load(BIAS + cols, mask=cols_ok, other=0.0).to(tl.float32)
        sums = tl.zeros([BLOCK_D], dtype=tl.float32)
        stop = tl.minimum(seq_len, first + CHUNK_ROWS)
        for r in range(first, stop, ROWS):
            pos = r + tl.arange(0, ROWS).to(tl.int64)  # positions in the sequence
            ok = pos < stop
            inside = ok[:, None] & cols_ok[None, :]
            rows = start + pos
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            mean = tl.sum(x, 1) / D
            centered = tl.where(inside, x - mean[:, None], 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 1) / D + eps)
            y = cast(centered * rstd[:, None] * w[None, :] + shift[None, :], HIST.dtype.element_ty, INTERP)
            tl.store(ROW_MEAN + rows, mean, mask=ok)
            tl.store(ROW_RSTD + rows, rstd, mask=ok)
            j = pos - LEAD
            in_hist = (ok & (j >= 0) & (j < hist_len))[:, None] & cols_ok[None, :]
            tl.store(HIST + (hist_start + j)[:, None] * D + cols[None, :], y, mask=in_hist)
            is_last = (ok & (pos == seq_len - 1))[:, None] & cols_ok[None, :]
            tl.store(LAST + b * D + (pos * 0)[:, None] + cols[None, :], y, mask=is_last)
            sums += tl.sum(tl.where(in_hist, y.to(tl.float32), 0.0), 0)
        tl.store(PARTIAL + (b * n_chunks + c) * D + cols, sums, mask=cols_ok)


@triton.jit
def _pool_mean(PARTIAL, OFFSETS, MEAN, LAST, n_chunks, D: tl.constexpr, BLOCK: tl.constexpr,
               CHUNK_ROWS: tl.constexpr, TAIL: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """Program ``(b, k)``: columns ``k * BLOCK ...`` of sequence ``b``'s mean, its chunks' sums added in
    order (NaN if the sequence has more chunks than the grid had: longer than ``max_len``); and of its
    last row when the sequence is empty (no forward program wrote it)."""
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cols_ok = cols < D
    seq_len = tl.load(OFFSETS + b + 1) - tl.load(OFFSETS + b)
    used = tl.minimum(tl.cdiv(seq_len, CHUNK_ROWS), n_chunks)  # the chunks the forward wrote
    sums = tl.zeros([BLOCK], dtype=tl.float32)
    for c in range(0, used):
        sums += tl.load(PARTIAL + (b * n_chunks + c) * D + cols, mask=cols_ok, other=0.0)
    mean = sums / tl.maximum(seq_len - TAIL, 1).to(tl.float32)
    mean = tl.where(tl.cdiv(seq_len, CHUNK_ROWS) > n_chunks, float("nan"), mean)  # longer than max_len: loud
    tl.store(MEAN + b * D + cols, cast(mean, MEAN.dtype.element_ty, INTERP), mask=cols_ok)
    tl.store(LAST + b * D + cols, cast(sums * 0.0, LAST.dtype.element_ty, INTERP), mask=cols_ok & (seq_len == 0))


@triton.jit
def _pool_bwd(X, W, OFFSETS, ROW_MEAN, ROW_RSTD, DHIST, DLAST, DMEAN, DX, DW_PART, DB_PART, stride_x,
              stride_dh, stride_dl, stride_dm, num_rows, num_seqs, search_steps, D: tl.constexpr,
              BLOCK_D: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr, LEAD: tl.constexpr,
              TAIL: tl.constexpr, HAS_DHIST: tl.constexpr, HAS_DLAST: tl.constexpr, HAS_DMEAN: tl.constexpr,
              PARAM_GRADS: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """Rows ``pid * TILES * ROWS ...`` of x: their gradient, and their column sums of dy * xhat and dy."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cols_ok = cols < D
    w = tl.load(W + cols, mask=cols_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    db = tl.zeros([BLOCK_D], dtype=tl.float32)
    for tile in range(0, TILES):
        rows = ((pid * TILES + tile) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        rows_ok = rows < num_rows
        inside = rows_ok[:, None] & cols_ok[None, :]
        # each row's sequence: the last b with offsets[b] <= row, by halving [0, B) search_steps times
        lo = tl.zeros([ROWS], dtype=tl.int64)
        hi = tl.zeros([ROWS], dtype=tl.int64) + num_seqs
        for _ in range(0, search_steps):
            mid = (lo + hi) // 2
            below = tl.load(OFFSETS + mid) <= rows
            lo = tl.where(below, mid, lo)
            hi = tl.where(below, hi, mid)
        start = tl.load(OFFSETS + lo)
        seq_len = tl.load(OFFSETS + lo + 1) - start
        pos = rows - start
        j = pos - LEAD
        hist_len = seq_len - TAIL
        in_hist = (rows_ok & (j >= 0) & (j < hist_len))[:, None] & cols_ok[None, :]
        dy = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
        if HAS_DHIST:
            hist_row = start - lo * TAIL + j
            dy += tl.load(DHIST + hist_row[:, None] * stride_dh + cols[None, :], mask=in_hist, other=0.0).to(tl.float32)
        if HAS_DMEAN:
            dm = tl.load(DMEAN + lo[:, None] * stride_dm + cols[None, :], mask=in_hist, other=0.0).to(tl.float32)
            dy += dm / tl.maximum(hist_len, 1).to(tl.float32)[:, None]
        if HAS_DLAST:
            is_last = (rows_ok & (pos == seq_len - 1))[:, None] & cols_ok[None, :]
            dy += tl.load(DLAST + lo[:, None] * stride_dl + cols[None, :], mask=is_last, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        mean = tl.load(ROW_MEAN + rows, mask=rows_ok, other=0.0)
        rstd = tl.load(ROW_RSTD + rows, mask=rows_ok, other=0.0)
        xhat = tl.where(inside, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        dx = (wdy - (tl.sum(wdy, 1) / D)[:, None] - xhat * (tl.sum(wdy * xhat, 1) / D)[:, None]) * rstd[:, None]
        tl.store(DX + rows[:, None] * D + cols[None, :], cast(dx, DX.dtype.element_ty, INTERP), mask=inside)
        if PARAM_GRADS:
            dw += tl.sum(dy * xhat, 0)
            db += tl.sum(dy, 0)
    if PARAM_GRADS:
        tl.store(DW_PART + pid.to(tl.int64) * D + cols, dw, mask=cols_ok)
        tl.store(DB_PART + pid.to(tl.int64) * D + cols, db, mask=cols_ok)


def _shape(dim: int) -> tuple[int, int, int]:
    """``(BLOCK_D, rows a register block, warps)``, as the layer norm's forward."""
    block_d = triton.next_power_of_2(dim)
    return block_d, rows_per_program(block_d), 4 if block_d <= 2048 else 8


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _SequencePool(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,  # type: ignore[override]
                offsets: torch.Tensor, lead: int, tail: int, max_len: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
        rows, dim = x.shape
        b = offsets.numel() - 1
        new = {"dtype": x.dtype, "device": x.device}
        hist, last, mean = torch.empty((rows - b * tail, dim), **new), torch.empty((b, dim), **new), torch.empty((b, dim), **new)  # fmt: skip
        row_mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        row_rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        chunk = CHUNK
        n_chunks = triton.cdiv(max_len, chunk)
        partial = torch.empty((b, n_chunks, dim), dtype=torch.float32, device=x.device)  # only used chunks written
        block_d, per, warps = _shape(dim)
        per = min(per, 1 << (chunk.bit_length() - 1))  # a power of two no larger than a chunk
        with device_guard(x.device):
            if rows and b:
                _pool_fwd[(b, n_chunks)](x, weight, bias, offsets, hist, last, row_mean, row_rstd, partial, x.stride(0),
                                         n_chunks, eps, D=dim, BLOCK_D=block_d, ROWS=per, CHUNK_ROWS=chunk,
                                         LEAD=lead, TAIL=tail, INTERP=INTERPRET, num_warps=warps)  # fmt: skip
            if b:
                block = min(MEAN_COLUMNS, block_d)
                _pool_mean[(b, triton.cdiv(dim, block))](partial, offsets, mean, last, n_chunks, D=dim, BLOCK=block,
                                                         CHUNK_ROWS=chunk, TAIL=tail, INTERP=INTERPRET)  # fmt: skip
        ctx.save_for_backward(x, weight, offsets, row_mean, row_rstd)
        ctx.lead, ctx.tail = lead, tail
        ctx.set_materialize_grads(False)  # an unused output's gradient is None: no zeros made up and read
        return hist, last, mean

    @staticmethod
    def backward(ctx: Any, d_hist: torch.Tensor | None, d_last: torch.Tensor | None,  # type: ignore[override]
                 d_mean: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:  # fmt: skip
        x, weight, offsets, row_mean, row_rstd = ctx.saved_tensors
        if d_hist is None and d_last is None and d_mean is None:
            return (None,) * 8
        rows, dim = x.shape
        b = offsets.numel() - 1
        block_d, per, warps = _shape(dim)
        per = max(1, per // 2)  # x and dy held at once: half the forward's rows, as the layer norm's backward
        tiles = max(1, BACKWARD_ROWS // per)
        programs = triton.cdiv(rows, per * tiles)
        params = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        dx = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
        dw_part = torch.empty((programs, dim) if params else (0,), dtype=torch.float32, device=x.device)
        db_part = torch.empty_like(dw_part)
        grads = [_rows(g) if g is not None else x for g in (d_hist, d_last, d_mean)]
        if rows:
            with device_guard(x.device):
                _pool_bwd[(programs,)](x, weight, offsets, row_mean, row_rstd, *grads, dx, dw_part, db_part,
                                       x.stride(0), *(g.stride(0) for g in grads), rows, b, max(b - 1, 0).bit_length(),
                                       D=dim, BLOCK_D=block_d, ROWS=per, TILES=tiles, LEAD=ctx.lead, TAIL=ctx.tail,
                                       HAS_DHIST=d_hist is not None, HAS_DLAST=d_last is not None,
                                       HAS_DMEAN=d_mean is not None, PARAM_GRADS=params, INTERP=INTERPRET,
                                       num_warps=warps)  # fmt: skip
        dweight = dw_part.sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        dbias = db_part.sum(0).to(weight.dtype) if ctx.needs_input_grad[2] else None
        return dx if ctx.needs_input_grad[0] else None, dweight, dbias, None, None, None, None, None


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor, lead: int,
           candidate: bool, max_len: int) -> int:  # fmt: skip
    """The rows each sequence has besides its history (``lead + candidate``), once the inputs are checked."""
    if x.dim() != 2 or not 1 <= x.shape[1] <= MAX_DIM or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"sequence_pool_triton: x must be rows [N, D] of bf16, fp16 or fp32 with 1 <= D <= "
                         f"{MAX_DIM}, got {x.dtype} {tuple(x.shape)}")  # fmt: skip
    for name, t in (("weight", weight), ("bias", bias)):
        if t.shape != (x.shape[1],) or not t.is_floating_point() or t.device != x.device:
            raise ValueError(f"sequence_pool_triton: {name} must be a float [{x.shape[1]}] on {x.device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")  # fmt: skip
    if offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype != torch.int64 or offsets.device != x.device:
        raise ValueError(f"sequence_pool_triton: offsets must be int64 [B + 1] on {x.device}, got {offsets.dtype} "
                         f"{tuple(offsets.shape)} on {offsets.device}")  # fmt: skip
    if isinstance(lead, bool) or lead not in (0, 1):
        raise ValueError(f"sequence_pool_triton: lead must be 0 or 1, got {lead!r}")
    b, rows, tail = offsets.numel() - 1, x.shape[0], lead + int(bool(candidate))
    if rows < b * tail:
        raise ValueError(f"sequence_pool_triton: x has {rows} rows, fewer than {b} sequences of {tail} rows "
                         f"besides the history each (lead={lead}, candidate={candidate})")  # fmt: skip
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1 or rows > b * max_len:
        raise ValueError(f"sequence_pool_triton: max_len must bound every length: {b} sequences of at most "
                         f"{max_len!r} rows cannot hold x's {rows}")  # fmt: skip
    return tail


def sequence_pool_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, offsets: torch.Tensor,
                         *, lead: int, candidate: bool, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(hist, last, mean)`` of :func:`sequence_pool_reference`, differentiable in ``x``, ``weight`` and
    ``bias``; no host syncs. ``max_len`` must bound every sequence's length (lead and candidate rows
    included): it sizes the grid. That is not checked on the host (it would read the lengths back): a
    longer sequence's rows past the grid are not written, and its mean is NaN, so that it shows."""
    tail = _check(x, weight, bias, offsets, lead, candidate, max_len)
    offsets = offsets.contiguous()
    return _SequencePool.apply(_rows(x), _rows(weight), _rows(bias), float(eps), offsets, lead, tail, max_len)


def sequence_pool_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                            offsets: torch.Tensor, *, lead: int, candidate: bool,
                            max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The same in torch: ``y = layer_norm(x) * weight + bias`` per row in float32 (or x's dtype if
    wider), rounded to x's dtype; ``hist``: every sequence's history rows (rows ``lead ..`` before the
    candidate, if any), in order; ``last [B, D]``: each sequence's last row (zeros if empty); ``mean
    [B, D]``: the mean of each history's rows of y, summed in float32 (zeros if empty), in x's dtype.
    ``max_len`` is unused (the kernel's grid)."""
    del max_len
    compute = torch.promote_types(x.dtype, torch.float32)
    y = F.layer_norm(x.to(compute), (x.shape[1],), weight.to(compute), bias.to(compute), eps).to(x.dtype)
    lengths = offsets.diff()
    b, tail = lengths.numel(), lead + int(candidate)
    hist_len = lengths - tail
    count = x.shape[0] - b * tail
    hist_starts = offsets[:-1] - torch.arange(b, device=x.device) * tail
    hist_rows = torch.arange(count, device=x.device) + torch.repeat_interleave(
        offsets[:-1] + lead - hist_starts, hist_len, output_size=count)  # fmt: skip
    hist = y[hist_rows]
    if y.shape[0]:
        last = torch.where((lengths > 0)[:, None], y[(offsets[1:] - 1).clamp(min=0)], y.new_zeros(()))
    else:
        last = y.new_zeros(b, x.shape[1])
    owner = torch.repeat_interleave(torch.arange(b, device=x.device), hist_len, output_size=count)
    sums = torch.zeros(b, x.shape[1], dtype=compute, device=x.device).index_add(0, owner, hist.to(compute))
    return hist, last, (sums / hist_len.clamp(min=1)[:, None]).to(x.dtype)
