"""The plan of the next-item loss's shared-negative GEMMs: sequences grouped by length into buckets,
buckets cut into chunks of at most ``CHUNK_ELEMENTS`` padded query elements, the index tensors
(:class:`Plan`) that place each predicted position in its chunk, and the row ranges of the per-row
work. :mod:`gem_model.model.next_item` (the loss and its scores) uses it and re-exports its names.
The constants are read at call time: set them here, not on ``next_item``, to change the plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gem_model.host_copy import to_device_async
from gem_model.jagged import offsets_of

BUCKET_GROWTH = 1.25
"""A bucket holds sequences with ``[size / BUCKET_GROWTH, size]`` predicted positions."""
SMALL_BUCKET = 64
"""Sequences this short share one bucket: padding them costs less than the ops of another chunk."""
CHUNK_ELEMENTS = 1 << 25
"""A chunk pads at most this many elements of queries (``rows * D``): 32768 rows at D = 1024."""


@dataclass(frozen=True)
class Chunk:
    """``count`` sequences padded to ``size`` rows each: ``slots`` (global, in the padded layout),
    ``valid`` (into the plan's ``valid_*``: the chunk's real rows) and ``seqs`` (into ``seqs``)."""

    size: int
    count: int
    slots: slice
    valid: slice
    seqs: slice


@dataclass(frozen=True)
class Plan:
    """Where each predicted position sits in the padded chunks (index tensors on the data's device).

    ``seqs``: the sequences in chunk order. Per slot of the padded layout: ``slot_rows`` (its query
    row; padding repeats its sequence's first one) and ``slot_preds`` (its predicted position, ``rows``
    for padding). Per predicted position in chunk order: ``valid_slots`` (its slot within its chunk)
    and ``valid_rows`` (its query row). Per predicted position in row order: ``pred_slots`` (its
    global slot), ``pred_rows`` (its query row) and ``pred_seqs`` (its sequence).
    """

    rows: int
    chunks: list[Chunk]
    seqs: Tensor
    slot_rows: Tensor
    slot_preds: Tensor
    valid_slots: Tensor
    valid_rows: Tensor
    pred_slots: Tensor
    pred_rows: Tensor
    pred_seqs: Tensor


def group_by_length(
    counts: list[int], dim: int, *, growth: float = BUCKET_GROWTH, small: int = SMALL_BUCKET,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> list[tuple[int, list[int]]]:
    """``(padded size, sequence indices)`` of each chunk, longest first; sequences with no row are left out."""
    buckets: list[tuple[int, list[int]]] = []
    for seq in sorted((b for b, n in enumerate(counts) if n > 0), key=lambda b: -counts[b]):
        n = counts[seq]
        if buckets and (n * growth >= buckets[-1][0] or buckets[-1][0] <= small):
            buckets[-1][1].append(seq)
        else:
            buckets.append((n, [seq]))
    max_rows = max(1, chunk_elements // max(dim, 1))
    chunks = []
    for size, seqs in buckets:
        per = max(1, max_rows // size)
        chunks += [(size, seqs[i : i + per]) for i in range(0, len(seqs), per)]
    return chunks


def plan_chunks(lengths: Tensor, dim: int, *, host_lengths: Tensor | None = None) -> Plan:
    """The :class:`Plan` of histories of ``lengths``.

    The host groups the sequences by their lengths (O(B) python): from ``host_lengths`` (the same
    lengths on the host) when given, else by reading ``lengths`` back (one sync). The O(P) index
    tensors are then built on the device from per-sequence numbers, copied over in one piece.
    """
    counts = (lengths - 1).clamp(min=0)
    n = (counts if host_lengths is None else (host_lengths - 1).clamp(min=0)).tolist()
    # the constants read at call time, so that a test can shrink them
    groups = group_by_length(n, dim, growth=BUCKET_GROWTH, small=SMALL_BUCKET, chunk_elements=CHUNK_ELEMENTS)
    chunks, order, size, start, chunk_start = [], [], [], [], []
    slot = valid = 0
    for s, seqs in groups:
        rows = sum(n[b] for b in seqs)
        chunks.append(Chunk(s, len(seqs), slice(slot, slot + s * len(seqs)), slice(valid, valid + rows),
                            slice(len(order), len(order) + len(seqs))))
        order += seqs
        size += [s] * len(seqs)
        start += range(slot, slot + s * len(seqs), s)
        chunk_start += [slot] * len(seqs)
        slot, valid = slot + s * len(seqs), valid + rows
    dev, total, m = lengths.device, valid, len(order)
    table = torch.tensor([order, size, start, chunk_start], dtype=torch.long)
    seqs, size_o, start_o, chunk_o = to_device_async(table, dev).reshape(4, m)
    first_row = offsets_of(lengths)[:-1]
    first_pred = offsets_of(counts)[:-1]
    n_o, row_o, pred_o = counts[seqs], first_row[seqs], first_pred[seqs]
    slot_seq = torch.repeat_interleave(torch.arange(m, device=dev), size_o, output_size=slot)
    j = torch.arange(slot, device=dev) - start_o[slot_seq]
    real = j < n_o[slot_seq]
    valid_seq = torch.repeat_interleave(torch.arange(m, device=dev), n_o, output_size=total)
    jv = torch.arange(total, device=dev) - offsets_of(n_o)[:-1][valid_seq]
    pred_seqs = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), counts, output_size=total)
    return Plan(
        rows=total,
        chunks=chunks,
        seqs=seqs,
        slot_rows=row_o[slot_seq] + torch.where(real, j, 0),
        slot_preds=torch.where(real, pred_o[slot_seq] + j, total),
        valid_slots=(start_o - chunk_o)[valid_seq] + jv,
        valid_rows=row_o[valid_seq] + jv,
        pred_slots=torch.empty(total, dtype=torch.long, device=dev).index_copy_(
            0, pred_o[valid_seq] + jv, start_o[valid_seq] + jv),
        pred_rows=torch.arange(total, device=dev) + (first_row - first_pred)[pred_seqs],
        pred_seqs=pred_seqs,
    )


def row_ranges(rows: int, dim: int) -> list[tuple[int, int]]:
    """Contiguous ranges of at most ``CHUNK_ELEMENTS / dim`` rows covering ``[0, rows)``."""
    step = max(1, CHUNK_ELEMENTS // max(dim, 1))
    return [(a, min(a + step, rows)) for a in range(0, rows, step)]
