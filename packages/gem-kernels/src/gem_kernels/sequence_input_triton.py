"""The sequence tower's first step in Triton (imports triton): each sequence's rows assembled from its
history's item and action embeddings, the context token in front, the candidate at the end and the
position table's rows added.

In torch (``gem_model.model.sequence_input.sequence_input_torch``) this is a bf16 add of the item and
action rows, an ``index_copy`` that makes room for the candidate (and the context token), a gather of the
position rows and another add; in backward, a gather and a sort-based embedding backward for the position
table: about 2.7 ms of a 200 ms step on the H100's big config (384 sequences, ~208,000 rows of 1,024
bf16). Here the forward reads each source row once and writes each row of x once. The backward reads x's
gradient once: a program takes a block of positions and columns, walks the sequences that reach it
(longest first, sorted by torch beforehand: a small sort of the B lengths, no host sync), writes their
rows' gradients (item, action, context token, candidate) and sums the position table's gradient in
float32 registers, in the sorted order. No atomics: the results are the same from run to run.

The math is :func:`sequence_input_reference`'s: each row computed in float32 and rounded once to
``dtype``; the position table's gradient summed in float32 (only the sums' order differs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard
from gem_kernels.row_blocks import MAX_DIM, rows_per_program
from gem_model.api import GradSection, grad_section

CHUNK = 128
"""Rows of one sequence a forward program takes (read at call time: tests set it small)."""

POS_BLOCK = 16
"""Positions a backward program takes (read at call time)."""

COL_BLOCK = 128
"""Columns a backward program takes (read at call time)."""

SEQUENCES = 2
"""Sorted sequences a backward program loads at once (their tiles' loads in flight together: the
program for the first positions walks all B sequences, the longest chain of the launch)."""

ROW_TYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _input_fwd(ITEM, ACTION, FIRST, LAST, POS, HIST_OFFSETS, X, scale, stride_item, stride_action, stride_first,
               stride_last, stride_pos, num_pos, limit, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
               CHUNK_ROWS: tl.constexpr, LEAD: tl.constexpr, TAIL: tl.constexpr, HAS_ACTION: tl.constexpr,
               HAS_POS: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """Program ``(b, c)``: positions ``c * CHUNK_ROWS ...`` of sequence ``b``, each row from its source
    (a history row, the context token or the candidate) plus its position row; all NaN if the sequence
    is longer than ``limit`` (``max_len``, or the position table's rows)."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    hist_start = tl.load(HIST_OFFSETS + b)
    hist_len = tl.load(HIST_OFFSETS + b + 1) - hist_start
    seq_len = hist_len + LEAD + TAIL
    out_start = hist_start + b * (LEAD + TAIL)
    first = c * CHUNK_ROWS
    if first < seq_len:
        cols = tl.arange(0, BLOCK_D)
        cols_ok = cols < D
        stop = tl.minimum(seq_len, first + CHUNK_ROWS)
        for r in range(first, stop, ROWS):
            pos = r + tl.arange(0, ROWS).to(tl.int64)  # positions in the sequence
            ok = pos < stop
            j = pos - LEAD  # the history row's index in the sequence's history
            in_hist = (ok & (j >= 0) & (j < hist_len))[:, None] & cols_ok[None, :]
            h = hist_start + j
            v = tl.load(ITEM + h[:, None] * stride_item + cols[None, :], mask=in_hist, other=0.0).to(tl.float32)
            v = v * scale
            if HAS_ACTION:
                action = tl.load(ACTION + h[:, None] * stride_action + cols[None, :], mask=in_hist, other=0.0)
                v += action.to(tl.float32)
            if LEAD:
                is_first = (ok & (pos == 0))[:, None] & cols_ok[None, :]
                v += tl.load(FIRST + b * stride_first + (pos * 0)[:, None] + cols[None, :], mask=is_first,
                             other=0.0).to(tl.float32)  # fmt: skip
            if TAIL:
                is_last = (ok & (pos == seq_len - 1))[:, None] & cols_ok[None, :]
                v += tl.load(LAST + b * stride_last + (pos * 0)[:, None] + cols[None, :], mask=is_last,
                             other=0.0).to(tl.float32)  # fmt: skip
            inside = ok[:, None] & cols_ok[None, :]
            if HAS_POS:
                in_table = (ok & (pos < num_pos))[:, None] & cols_ok[None, :]
                v += tl.load(POS + pos[:, None] * stride_pos + cols[None, :], mask=in_table, other=0.0).to(tl.float32)
            v = tl.where(seq_len > limit, float("nan"), v)  # longer than the launch was sized for: loud
            out = cast(v, X.dtype.element_ty, INTERP)
            tl.store(X + (out_start + pos)[:, None] * D + cols[None, :], out, mask=inside)


@triton.jit
def _input_bwd(G, SEQS, COUNTS, D_ITEM, D_ACTION, D_FIRST, D_LAST, D_POS, scale, stride_g, num_pos,
               D: tl.constexpr, POS_ROWS: tl.constexpr, COLS: tl.constexpr, AT_ONCE: tl.constexpr,
               LEAD: tl.constexpr, TAIL: tl.constexpr, ITEM_GRAD: tl.constexpr, ACTION_GRAD: tl.constexpr,
               FIRST_GRAD: tl.constexpr, LAST_GRAD: tl.constexpr, POS_GRAD: tl.constexpr, ITEM_ADD: tl.constexpr,
               INTERP: tl.constexpr):  # fmt: skip
    """Program ``k * cdiv(D, COLS) + n``: positions ``k * POS_ROWS ...``, columns ``n * COLS ...`` (the
    first positions, the most work, start first). ``SEQS [B, 3]``: the sequences ``(b, history start,
    length)`` longest first; ``COUNTS[k]``: how many reach position ``k * POS_ROWS``. Their gradient rows
    there, ``AT_ONCE`` sequences at a time, and their sum. ``ITEM_ADD``: ``D_ITEM`` holds a gradient
    already, and the item rows' are added to it (in float32, rounded once)."""
    k = tl.program_id(0) // tl.cdiv(D, COLS)
    pos = (k * POS_ROWS + tl.arange(0, POS_ROWS)).to(tl.int64)
    cols = tl.program_id(0) % tl.cdiv(D, COLS) * COLS + tl.arange(0, COLS)
    cols_ok = cols < D
    p3 = pos[None, :, None]  # [sequences, positions, columns]
    c3 = cols[None, None, :]
    count = tl.load(COUNTS + k)
    acc = tl.zeros([POS_ROWS, COLS], dtype=tl.float32)
    for i in range(0, count, AT_ONCE):
        s = i + tl.arange(0, AT_ONCE)
        s_ok = s < count
        b = tl.load(SEQS + s * 3, mask=s_ok, other=0)[:, None, None]
        hist_start = tl.load(SEQS + s * 3 + 1, mask=s_ok, other=0)[:, None, None]
        seq_len = tl.load(SEQS + s * 3 + 2, mask=s_ok, other=0)[:, None, None]  # 0 past count: no rows
        inside = (p3 < seq_len) & cols_ok[None, None, :]
        rows = hist_start + b * (LEAD + TAIL) + p3
        g = tl.load(G + rows * stride_g + c3, mask=inside, other=0.0).to(tl.float32)
        if POS_GRAD:
            acc += tl.sum(g, 0)
        j = p3 - LEAD
        in_hist = inside & (j >= 0) & (j < seq_len - LEAD - TAIL)
        if ITEM_GRAD:
            d_item = g * scale
            if ITEM_ADD:
                d_item += tl.load(D_ITEM + (hist_start + j) * D + c3, mask=in_hist, other=0.0).to(tl.float32)
            tl.store(D_ITEM + (hist_start + j) * D + c3, cast(d_item, D_ITEM.dtype.element_ty, INTERP), mask=in_hist)
        if ACTION_GRAD:
            tl.store(D_ACTION + (hist_start + j) * D + c3, cast(g, D_ACTION.dtype.element_ty, INTERP), mask=in_hist)
        if FIRST_GRAD:
            tl.store(D_FIRST + b * D + p3 * 0 + c3, cast(g, D_FIRST.dtype.element_ty, INTERP), mask=inside & (p3 == 0))
        if LAST_GRAD:
            tl.store(D_LAST + b * D + p3 * 0 + c3, cast(g, D_LAST.dtype.element_ty, INTERP),
                     mask=inside & (p3 == seq_len - 1))  # fmt: skip
    if POS_GRAD:  # every row of the table: zeros where no sequence reaches
        reached = (pos < num_pos)[:, None] & cols_ok[None, :]
        tl.store(D_POS + pos[:, None] * D + cols[None, :], cast(acc, D_POS.dtype.element_ty, INTERP), mask=reached)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


class _SequenceInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, item: torch.Tensor, action: torch.Tensor | None, first: torch.Tensor | None,  # type: ignore[override]
                last: torch.Tensor | None, position: torch.Tensor | None, hist_lengths: torch.Tensor,
                hist_offsets: torch.Tensor, scale: float, dtype: torch.dtype, max_len: int,
                sections: tuple[GradSection | None, ...]) -> torch.Tensor:  # fmt: skip
        hist_rows, dim = item.shape
        b = hist_lengths.numel()
        lead, tail = int(first is not None), int(last is not None)
        x = torch.empty((hist_rows + b * (lead + tail), dim), dtype=dtype, device=item.device)
        num_pos = position.shape[0] if position is not None else 0
        chunk = CHUNK
        block_d = triton.next_power_of_2(dim)
        per = min(rows_per_program(block_d), 1 << (chunk.bit_length() - 1))  # a power of two, at most a chunk
        if x.shape[0]:
            srcs = [t if t is not None else item for t in (action, first, last, position)]
            with device_guard(item.device):
                _input_fwd[(b, triton.cdiv(max_len, chunk))](
                    item, *srcs, hist_offsets, x, scale, item.stride(0), *(t.stride(0) for t in srcs), num_pos,
                    min(max_len, num_pos) if position is not None else max_len, D=dim, BLOCK_D=block_d, ROWS=per,
                    CHUNK_ROWS=chunk, LEAD=lead, TAIL=tail, HAS_ACTION=action is not None,
                    HAS_POS=position is not None, INTERP=INTERPRET, num_warps=4 if block_d <= 2048 else 8)  # fmt: skip
        ctx.save_for_backward(hist_lengths, hist_offsets)
        ctx.scale, ctx.max_len, ctx.lead, ctx.tail, ctx.hist_rows = scale, max_len, lead, tail, hist_rows
        ctx.types = [t.dtype if t is not None else None for t in (item, action, first, last, position)]
        ctx.num_pos, ctx.sections = num_pos, sections
        return x

    @staticmethod
    def backward(ctx: Any, dx: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        hist_lengths, hist_offsets = ctx.saved_tensors
        needs = ctx.needs_input_grad[:5]
        if not any(needs):
            return (None,) * 11
        g = _rows(dx)
        rows, dim = g.shape
        b, dev = hist_lengths.numel(), g.device
        into, add_item = _claimed(needs, ctx.sections)
        # scale 1: item's and action's gradients are the same values, written once and returned for both;
        # autograd copies a gradient that is still referenced elsewhere before anything accumulates into it
        shared = needs[0] and needs[1] and ctx.scale == 1.0 and ctx.types[0] == ctx.types[1] and into[0] is None and into[1] is None
        sizes = (ctx.hist_rows, ctx.hist_rows, b, b, ctx.num_pos)
        grads = [torch.empty((n, dim), dtype=t, device=dev) if need and into[i] is None and not (shared and i == 1)
                 else None for i, (need, t, n) in enumerate(zip(needs, ctx.types, sizes, strict=True))]  # fmt: skip
        if shared:
            grads[1] = grads[0]
        out = [t if t is not None else grads[i] for i, t in enumerate(into)]  # where the kernel writes
        pos_block, col_block = POS_BLOCK, min(COL_BLOCK, triton.next_power_of_2(dim))
        extent = max(ctx.max_len, ctx.num_pos if needs[4] else 0)  # every row's position, every table row
        blocks = triton.cdiv(extent, pos_block)
        if rows == 0 or b == 0:  # no rows (nor claimed ones): only the position table's gradient, zeros
            if grads[4] is not None:
                grads[4].zero_()
        else:
            lengths = hist_lengths + (ctx.lead + ctx.tail)
            sorted_len, order = torch.sort(lengths, descending=True, stable=True)
            seqs = torch.stack((order, hist_offsets[:-1][order], sorted_len), 1).contiguous()
            starts = torch.arange(blocks, device=dev, dtype=torch.int64) * pos_block
            counts = torch.searchsorted(-sorted_len, -starts)  # the sequences longer than each block's start
            with device_guard(dev):
                _input_bwd[(blocks * triton.cdiv(dim, col_block),)](
                    g, seqs, counts, *(t if t is not None else g for t in out), ctx.scale, g.stride(0),
                    ctx.num_pos, D=dim, POS_ROWS=pos_block, COLS=col_block, AT_ONCE=SEQUENCES, LEAD=ctx.lead,
                    TAIL=ctx.tail, ITEM_GRAD=needs[0], ACTION_GRAD=needs[1] and not shared, FIRST_GRAD=needs[2],
                    LAST_GRAD=needs[3], POS_GRAD=needs[4], ITEM_ADD=add_item, INTERP=INTERPRET, num_warps=4)  # fmt: skip
        return (*grads, None, None, None, None, None, None)


def _claimed(needs: tuple[bool, ...], sections: tuple[GradSection | None, ...]) -> tuple[list[torch.Tensor | None], bool]:
    """The rows of the lookup's gradient buffer that the item, action and candidate gradients go into
    (:mod:`gem_model.table_grad`), None where an input has no section (or, for the action and candidate,
    where another kernel wrote its rows first: then its gradient is returned, and the buffer's node adds
    it); and whether the item rows hold a gradient already, to which the kernel adds its own."""
    into: list[torch.Tensor | None] = [None] * 5
    add_item = False
    for i in (0, 1, 3):
        if needs[i] and sections[i] is not None:
            rows, accumulate = sections[i].claim()
            if not accumulate or i == 0:
                into[i], add_item = rows, add_item or accumulate
    return into, add_item


def _check(item: torch.Tensor, action: torch.Tensor | None, hist_lengths: torch.Tensor, hist_offsets: torch.Tensor,
           first: torch.Tensor | None, last: torch.Tensor | None, position: torch.Tensor | None, dtype: torch.dtype,
           max_len: int) -> None:  # fmt: skip
    where = "sequence_input_triton"
    if item.dim() != 2 or not 1 <= item.shape[1] <= MAX_DIM or item.dtype not in ROW_TYPES:
        raise ValueError(f"{where}: item must be rows [Nh, D] of bf16, fp16 or fp32 with 1 <= D <= {MAX_DIM}, "
                         f"got {item.dtype} {tuple(item.shape)}")  # fmt: skip
    dim, dev = item.shape[1], item.device
    if action is not None and (action.shape != item.shape or action.dtype != item.dtype or action.device != dev):
        raise ValueError(f"{where}: action must be item's {item.dtype} {tuple(item.shape)} on {dev}, got "
                         f"{action.dtype} {tuple(action.shape)} on {action.device}")  # fmt: skip
    if hist_lengths.dim() != 1 or hist_lengths.dtype != torch.int64 or hist_lengths.device != dev:
        raise ValueError(f"{where}: hist_lengths must be int64 [B] on {dev}, got {hist_lengths.dtype} "
                         f"{tuple(hist_lengths.shape)} on {hist_lengths.device}")  # fmt: skip
    b = hist_lengths.numel()
    if hist_offsets.shape != (b + 1,) or hist_offsets.dtype != torch.int64 or hist_offsets.device != dev:
        raise ValueError(f"{where}: hist_offsets must be int64 [B + 1] = [{b + 1}] on {dev}, got "
                         f"{hist_offsets.dtype} {tuple(hist_offsets.shape)} on {hist_offsets.device}")  # fmt: skip
    for name, t in (("first", first), ("last", last)):
        if t is not None and (t.shape != (b, dim) or not t.is_floating_point() or t.device != dev):
            raise ValueError(f"{where}: {name} must be a float [B, D] = [{b}, {dim}] on {dev}, got {t.dtype} "
                             f"{tuple(t.shape)} on {t.device}")  # fmt: skip
    if position is not None and (position.dim() != 2 or position.shape[0] < 1 or position.shape[1] != dim
                                 or not position.is_floating_point() or position.device != dev):  # fmt: skip
        raise ValueError(f"{where}: position must be a float table [P, {dim}] with P >= 1 on {dev}, got "
                         f"{position.dtype} {tuple(position.shape)} on {position.device}")  # fmt: skip
    if dtype not in ROW_TYPES:
        raise ValueError(f"{where}: dtype must be bf16, fp16 or fp32, got {dtype}")
    rows = item.shape[0] + b * (int(first is not None) + int(last is not None))
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1 or rows > b * max_len:
        raise ValueError(f"{where}: max_len must bound every output length: {b} sequences of at most "
                         f"{max_len!r} rows cannot hold x's {rows}")  # fmt: skip


def sequence_input_triton(item: torch.Tensor, action: torch.Tensor | None, hist_lengths: torch.Tensor,
                          hist_offsets: torch.Tensor, *, scale: float, first: torch.Tensor | None,
                          last: torch.Tensor | None, position: torch.Tensor | None, dtype: torch.dtype,
                          max_len: int) -> torch.Tensor:  # fmt: skip
    """x of :func:`sequence_input_reference`, differentiable in ``item``, ``action``, ``first``, ``last``
    and ``position``; no host syncs. ``max_len`` must bound every output sequence's length (context token
    and candidate included; ``position``'s rows must too): it sizes the grid. That is not checked on the
    host (it would read the lengths back): a longer sequence's rows are NaN, those past the grid unwritten."""
    _check(item, action, hist_lengths, hist_offsets, first, last, position, dtype, max_len)
    # the gradients of views of a lookup's one gradient buffer go into its rows (gem_model.table_grad)
    sections = (grad_section(item), grad_section(action), None, grad_section(last), None)
    item, action, first, last, position = (t if t is None else _rows(t) for t in (item, action, first, last, position))
    return _SequenceInput.apply(item, action, first, last, position, hist_lengths.contiguous(),
                                hist_offsets.contiguous(), float(scale), dtype, max_len, sections)  # fmt: skip


def sequence_input_reference(item: torch.Tensor, action: torch.Tensor | None, hist_lengths: torch.Tensor,
                             hist_offsets: torch.Tensor, *, scale: float, first: torch.Tensor | None,
                             last: torch.Tensor | None, position: torch.Tensor | None, dtype: torch.dtype,
                             max_len: int) -> torch.Tensor:  # fmt: skip
    """The same in torch: sequence ``b``'s rows are ``first[b]`` (if given), its history rows ``item *
    scale + action`` (``hist_offsets[b]:hist_offsets[b+1]``), ``last[b]`` (if given), each plus
    ``position[p]`` at position ``p`` of the sequence (if given); in float32 (or the inputs' dtype if
    wider), rounded once to ``dtype``. ``max_len`` is unused (the kernel's grid)."""
    del max_len
    compute = torch.float32
    for t in (item, action, first, last, position):
        compute = compute if t is None else torch.promote_types(compute, t.dtype)
    hist = item.to(compute) * scale
    hist = hist if action is None else hist + action.to(compute)
    b, lead, tail = hist_lengths.numel(), int(first is not None), int(last is not None)
    rows, dev = item.shape[0] + b * (lead + tail), item.device
    extra = torch.arange(b, device=dev) * (lead + tail)  # rows before each sequence besides the histories
    starts = hist_offsets[:-1] + extra
    lengths = hist_lengths + lead + tail
    hist_rows = torch.arange(item.shape[0], device=dev) + torch.repeat_interleave(
        extra + lead, hist_lengths, output_size=item.shape[0])  # fmt: skip
    x = hist.new_zeros(rows, item.shape[1]).index_copy(0, hist_rows, hist)
    if first is not None:
        x = x.index_copy(0, starts, first.to(compute))
    if last is not None:
        x = x.index_copy(0, starts + lengths - 1, last.to(compute))
    if position is not None:
        positions = torch.arange(rows, device=dev) - torch.repeat_interleave(starts, lengths, output_size=rows)
        x = x + F.embedding(positions, position.to(compute))
    return x.to(dtype)
