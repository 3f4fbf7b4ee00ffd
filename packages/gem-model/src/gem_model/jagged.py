"""Small index helpers for jagged (values + lengths) layouts, used by the data and the model."""

from __future__ import annotations

import torch


def offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    """``[B + 1]`` offsets (starting at 0) of ``[B]`` lengths."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.long, device=lengths.device)
    torch.cumsum(lengths, 0, out=out[1:])
    return out


def gather_rows(offsets: torch.Tensor, lengths: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Flat value indices of the sequences ``indices`` (in that order)."""
    lens = lengths[indices]
    starts = offsets[indices]
    total = int(lens.sum())
    new_starts = offsets_of(lens)[:-1]
    shift = torch.repeat_interleave(starts - new_starts, lens, output_size=total)
    return torch.arange(total, device=lengths.device) + shift


def sequence_ids(lengths: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """For each value, the index of the sequence it belongs to."""
    n = int(lengths.sum()) if total is None else total
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths, output_size=n)


def positions_in_sequence(
    lengths: torch.Tensor, offsets: torch.Tensor | None = None, *, total: int | None = None
) -> torch.Tensor:
    """For each value, its position (0-based) within its own sequence. ``total``: the number of values,
    when the caller knows it (else it is read from the device: a host sync)."""
    offsets = offsets_of(lengths) if offsets is None else offsets
    total = int(offsets[-1]) if total is None else total
    return torch.arange(total, device=lengths.device) - torch.repeat_interleave(
        offsets[:-1], lengths, output_size=total
    )


def _as_words(t: torch.Tensor) -> torch.Tensor:
    """``t`` (rows along dim 0) as rows of 8-byte words when its rows are contiguous and a whole number
    of words, else ``t``: torch's ``index_copy_`` moves one element per thread, so bf16 rows copy 2 bytes
    at a time where the same rows as int64 move 8."""
    row_bytes = t[0].numel() * t.element_size() if t.dim() > 1 and t.shape[0] else 0
    if row_bytes and row_bytes % 8 == 0 and t.is_contiguous() and t.data_ptr() % 8 == 0:
        return t.view(t.shape[0], -1).view(torch.int64)
    return t


def _interleaved(a: torch.Tensor, b: torch.Tensor, index_a: torch.Tensor, index_b: torch.Tensor) -> torch.Tensor:
    """A fresh tensor with ``out[index_a] = a`` and ``out[index_b] = b``: the two indices cover its rows
    exactly once between them, so each row is written once (no zero fill)."""
    out = a.new_empty((a.shape[0] + b.shape[0], *a.shape[1:]))
    # contiguous (a no-op for the history rows; the candidates' gradient is a strided slice of the
    # stacked tokens' gradient, [B, D]), so that both can move as words
    a, b = a.contiguous(), b.contiguous()
    words_a, words_b, words = _as_words(a), _as_words(b), _as_words(out)
    if not (words_a.dtype == words_b.dtype == words.dtype == torch.int64):
        words_a, words_b, words = a, b, out
    words.index_copy_(0, index_a, words_a)
    words.index_copy_(0, index_b, words_b)
    return out


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, index)``, gathered as 8-byte words where :func:`_as_words` allows."""
    words = _as_words(t)
    if words is t:
        return t.index_select(0, index)
    return words.index_select(0, index).view(t.dtype).view(index.numel(), *t.shape[1:])


class _Interleave(torch.autograd.Function):
    """:func:`_interleaved`, whose backward gathers each input's rows back."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, index_a: torch.Tensor, index_b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index_a, index_b)
        return _interleaved(a, b, index_a, index_b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        index_a, index_b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[:2]
        return _rows(grad, index_a) if need_a else None, _rows(grad, index_b) if need_b else None, None, None


class _Split(torch.autograd.Function):
    """``(x[index_a], x[index_b])`` for two indices that cover ``x``'s rows exactly once between them;
    the backward writes each row of ``x``'s gradient once (:func:`_interleaved`), where indexing's
    backward fills zeros, scatters with accumulation (a sort) and adds the two uses' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index_a: torch.Tensor, index_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        ctx.save_for_backward(index_a, index_b)
        return _rows(x, index_a), _rows(x, index_b)

    @staticmethod
    def backward(ctx, grad_a: torch.Tensor, grad_b: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        index_a, index_b = ctx.saved_tensors
        return _interleaved(grad_a, grad_b, index_a, index_b), None, None


def split_rows(x: torch.Tensor, index_a: torch.Tensor, index_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x[index_a], x[index_b])``, differentiable, for two indices that together name every row of
    ``x`` exactly once (each sequence's history rows and its last row, say); the counts are checked,
    not the indices' values (that would read them back from the device)."""
    if index_a.numel() + index_b.numel() != x.shape[0]:
        raise ValueError(f"split_rows: the two indices must cover the {x.shape[0]} rows exactly once, got "
                         f"{index_a.numel()} + {index_b.numel()} rows")  # fmt: skip
    return _Split.apply(x, index_a, index_b)


def insert_one(
    values: torch.Tensor, lengths: torch.Tensor, extra: torch.Tensor, *, at_start: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Put ``extra[b]`` at the end (or, ``at_start``, the front) of sequence ``b``.

    Returns the new values and lengths; differentiable in ``values`` and ``extra``. Rows of
    ``values`` move down by the number of sequences before them (plus one when inserting in front).
    One pass writes each row once (no zero fill, no out-of-place copies), and the backward gathers
    each input's rows of the gradient.
    """
    b = lengths.numel()
    new_lengths = lengths + 1
    new_offsets = offsets_of(new_lengths)
    shift = sequence_ids(lengths, values.shape[0]) + (1 if at_start else 0)
    hist_index = torch.arange(values.shape[0], device=values.device) + shift
    extra_index = new_offsets[:-1] if at_start else new_offsets[1:] - 1
    if extra.shape != (b, *values.shape[1:]):
        raise ValueError(f"insert_one: extra must be [{b}, ...] like the values' rows {tuple(values.shape[1:])}, "
                         f"got {tuple(extra.shape)}")  # fmt: skip
    return _Interleave.apply(values, extra.to(values.dtype), hist_index, extra_index), new_lengths


def append_one(values: torch.Tensor, lengths: torch.Tensor, extra: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``extra[b]`` at the end of sequence ``b``."""
    return insert_one(values, lengths, extra)


def prepend_one(values: torch.Tensor, lengths: torch.Tensor, first: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Put ``first[b]`` before the rows of sequence ``b``."""
    return insert_one(values, lengths, first, at_start=True)


class _GatherBias(torch.autograd.Function):
    """``table[index]`` whose backward sums the gradient per table entry with ``bincount``.

    Plain indexing's backward is an accumulating ``index_put_``, slow when millions of (query, key)
    pairs hit a few hundred entries; a weighted ``bincount`` is a histogram. On the H200, one
    attention call's forward + backward with the time bias: 53.8 ms with indexing, 14.5 ms with this
    (8.3 ms without any bias; ``benchmarks/attention_bias.py``).
    """

    @staticmethod
    def forward(ctx, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(index)
        ctx.size = table.numel()
        return table[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        (index,) = ctx.saved_tensors
        summed = torch.bincount(index.reshape(-1), weights=grad.reshape(-1), minlength=ctx.size)
        return summed.to(grad.dtype), None


def gather_bias(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D bias ``table`` (differentiable in ``table``; see :class:`_GatherBias`)."""
    if not table.requires_grad:
        return table[index]
    return _GatherBias.apply(table, index)


def relative_bias_matrix(position_bias: torch.Tensor, size: int, max_seq_len: int) -> torch.Tensor:
    """``[size, size]`` matrix ``B[i, j] = position_bias[j - i + max_seq_len - 1]`` (relative positions)."""
    if position_bias.shape != (2 * max_seq_len - 1,):
        raise ValueError(
            f"position_bias must be [2 * max_seq_len - 1] = [{2 * max_seq_len - 1}], got {tuple(position_bias.shape)}"
        )
    if size > max_seq_len:
        raise ValueError(f"a sequence of {size} rows is longer than max_seq_len {max_seq_len}")
    pos = torch.arange(size, device=position_bias.device)
    # plain indexing: its gradient arrives summed over the batch already ([size, size] pairs), where
    # an accumulating index_put_ is a little faster than a bincount (benchmarks/results/attention_bias.md)
    return position_bias[pos[None, :] - pos[:, None] + max_seq_len - 1]


TIME_BUCKET_STEP = 0.301
"""Width of one time bucket in natural-log seconds (HSTU's bucketing: ``ln(|dt|) / 0.301``)."""


def time_buckets(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """Bucket of each time difference (seconds): ``min(floor(ln(max(|dt|, 1)) / 0.301), num_buckets - 1)``.

    Bucket 0 holds differences under 1.35 s; each next bucket covers 1.35x longer spans.
    """
    logs = torch.log(dt.abs().clamp(min=1).to(torch.float64)) / TIME_BUCKET_STEP
    return logs.long().clamp(max=num_buckets - 1)


def time_bucket_matrix(query_times: torch.Tensor, key_times: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``[..., n, n]`` bucket ids ``time_buckets(query_times[i] - key_times[j])`` of ``[..., n]`` timestamps."""
    return time_buckets(query_times[..., :, None] - key_times[..., None, :], num_buckets)


def time_bias_matrix(time_bias: torch.Tensor, query_times: torch.Tensor, key_times: torch.Tensor) -> torch.Tensor:
    """``[..., n, n]`` matrix ``B[i, j] = time_bias[bucket(query_times[i] - key_times[j])]``.

    ``query_times`` and ``key_times`` are ``[..., n]`` integer timestamps (seconds); ``time_bias`` is
    ``[num_buckets]``. Differentiable in ``time_bias``.
    """
    if time_bias.dim() != 1 or time_bias.numel() == 0:
        raise ValueError(f"time_bias must be a non-empty [num_buckets] vector, got {tuple(time_bias.shape)}")
    if query_times.is_floating_point() or key_times.is_floating_point():
        raise ValueError(
            f"timestamps must be integers (seconds), got {query_times.dtype} and {key_times.dtype}"
        )
    return gather_bias(time_bias, time_bucket_matrix(query_times, key_times, time_bias.numel()))


MEMBERSHIP_GEMM_ELEMENTS = 1 << 28
"""Largest ``sequences x rows`` membership matrix (bf16: 512 MiB) that :func:`segment_mean` multiplies
on a GPU; a larger batch (and any batch on the CPU) sums with ``index_add``. 0 turns the GEMM off."""


def _membership(owner: torch.Tensor, sequences: int, dtype: torch.dtype) -> torch.Tensor:
    """``[sequences, rows]``: 1 where row ``j`` belongs to sequence ``i`` (``owner[j] == i``), else 0."""
    rows = owner.numel()
    member = torch.zeros(sequences, rows, dtype=dtype, device=owner.device)
    one = torch.ones((), dtype=dtype, device=owner.device)
    return member.index_put_((owner, torch.arange(rows, device=owner.device)), one)


def matmul_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (matrices, or batches of them: ``mm`` or ``bmm``) in ``a``'s dtype with a float32 result:
    cuBLAS accumulates in float32 and writes float32 (torch >= 2.8); elsewhere the same products of
    float32 copies."""
    op = torch.bmm if a.dim() == 3 else torch.mm
    if a.dtype == torch.float32:
        return op(a, b)
    if a.is_cuda:
        try:
            return op(a, b, out_dtype=torch.float32)
        except TypeError:
            pass
    return op(a.float(), b.float())


class _SegmentSum(torch.autograd.Function):
    """``[sequences, D]`` float32 sums of each sequence's rows of ``values`` (16-bit), as one GEMM with
    their 0/1 membership matrix. The backward hands each row its sequence's gradient, cast to the rows'
    dtype (a gather of ``[sequences, D]`` rows)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, owner: torch.Tensor, sequences: int) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(owner)
        ctx.dtype = values.dtype
        return matmul_fp32(_membership(owner, sequences, values.dtype), values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        (owner,) = ctx.saved_tensors
        return grad.to(ctx.dtype).index_select(0, owner), None, None


def segment_mean(values: torch.Tensor, lengths: torch.Tensor, *, gemm: bool | None = None) -> torch.Tensor:
    """``[B, D]``: the mean of each sequence's rows of ``values [N, D]`` (the rows of sequence ``i`` are
    contiguous, in order; ``N = lengths.sum()``), summed in float32 and returned in ``values``' dtype;
    zeros for an empty sequence.

    On a GPU with 16-bit values the sums are one GEMM with the ``[B, N]`` membership matrix (when it has
    at most :data:`MEMBERSHIP_GEMM_ELEMENTS` entries): ``index_add`` of float32 copies makes every row of
    a sequence add atomically into the same ``D`` sums, and needs the copy (``benchmarks/segment_mean.py``
    measures both); without atomics the GPU's result is also the same from run to run. ``gemm`` forces
    the choice (True: the GEMM also on the CPU, in float32)."""
    b, n = lengths.numel(), values.shape[0]
    owner = sequence_ids(lengths, n)
    if gemm is None:
        gemm = values.is_cuda and values.dtype in (torch.bfloat16, torch.float16) and b * n <= MEMBERSHIP_GEMM_ELEMENTS
    if gemm and values.dtype in (torch.bfloat16, torch.float16):
        sums = _SegmentSum.apply(values, owner, b)
    else:
        sums = values.new_zeros(b, values.shape[1], dtype=torch.float32).index_add(0, owner, values.float())
    return (sums / lengths.clamp(min=1)[:, None]).to(values.dtype)
