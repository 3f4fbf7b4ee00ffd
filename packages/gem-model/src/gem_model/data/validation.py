"""Checks a batch before any embedding lookup, so bad input fails with a message that says where."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from gem_model.data.batch import NEG_ITEM, SEQ_ACTION, SEQ_ITEM, Batch, FeatureSpec


def check_jagged(kjt: KeyedJaggedTensor, where: str) -> None:
    """Lengths must be non-negative and add up to the number of values; offsets must agree."""
    lengths = kjt.lengths()
    values = kjt.values()
    if lengths.numel() and int(lengths.min()) < 0:
        bad = int(lengths.min())
        raise ValueError(f"{where}: negative length {bad}; lengths must be >= 0")
    total = int(lengths.sum()) if lengths.numel() else 0
    if total != values.numel():
        raise ValueError(f"{where}: lengths add up to {total} but there are {values.numel()} values")
    offsets = kjt.offsets()
    if offsets.numel():
        expected = torch.zeros(lengths.numel() + 1, dtype=offsets.dtype, device=offsets.device)
        expected[1:] = torch.cumsum(lengths, 0)
        if not torch.equal(offsets, expected):
            raise ValueError(f"{where}: offsets {offsets.tolist()[:8]}... do not match the lengths")


def check_ids(feature: str, ids: torch.Tensor, table: str, num_rows: int) -> None:
    if ids.numel() == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= num_rows:
        bad = lo if lo < 0 else hi
        raise ValueError(
            f"feature {feature!r}: id {bad} is outside table {table!r}, whose allowed range is [0, {num_rows - 1}]"
        )


def check_feature_ids(features: Mapping[str, JaggedTensor], spec: FeatureSpec) -> None:
    """Every feature's ids inside its table's rows: the id range check, before any lookup
    (``benchmarks/id_check.py`` times it against the step)."""
    for key, jt in features.items():
        table, rows = spec.table_of(key)
        check_ids(key, jt.values(), table, rows)


def validate_batch(batch: Batch, spec: FeatureSpec) -> None:
    """Raise ``ValueError`` naming the feature, table, value and allowed range of any bad input."""
    b = batch.batch_size
    check_jagged(batch.sequence, "sequence features")
    check_jagged(batch.pooled, "pooled features")
    seq = batch.sequence.to_dict()
    for key, jt in seq.items():
        if jt.lengths().numel() != b:
            raise ValueError(f"feature {key!r}: {jt.lengths().numel()} samples, expected the batch size {b}")
    check_feature_ids(seq, spec)
    if not torch.equal(seq[SEQ_ITEM].lengths(), seq[SEQ_ACTION].lengths()):
        raise ValueError(f"features {SEQ_ITEM!r} and {SEQ_ACTION!r} must have the same lengths per sample")
    neg_lengths = seq[NEG_ITEM].lengths()
    expected = spec.negatives_of(seq[SEQ_ITEM].lengths())
    if neg_lengths.numel() and not torch.equal(neg_lengths, expected):
        b_bad = int(torch.nonzero(neg_lengths != expected)[0, 0])
        per = "each predicted position" if spec.negatives_per_position else "every sample"
        raise ValueError(
            f"feature {NEG_ITEM!r}: {per} needs exactly {spec.num_negatives} negatives; sample {b_bad} has "
            f"{int(neg_lengths[b_bad])}, expected {int(expected[b_bad])}"
        )
    too_long = seq[SEQ_ITEM].lengths() > spec.max_history
    if bool(too_long.any()):
        n = int(seq[SEQ_ITEM].lengths().max())
        raise ValueError(f"feature {SEQ_ITEM!r}: history of length {n} exceeds max_history {spec.max_history}")
    expected_pooled = {p.name for p in spec.pooled}
    if set(batch.pooled.keys()) != expected_pooled:
        raise ValueError(
            f"pooled features {sorted(batch.pooled.keys())} do not match the feature spec {sorted(expected_pooled)}"
        )
    check_feature_ids(batch.pooled.to_dict(), spec)
    if tuple(batch.dense.shape) != (b, spec.num_dense):
        raise ValueError(f"dense features: shape {tuple(batch.dense.shape)}, expected {(b, spec.num_dense)}")
    if tuple(batch.labels.shape) != (b, len(spec.tasks)):
        raise ValueError(f"labels: shape {tuple(batch.labels.shape)}, expected {(b, len(spec.tasks))}")
    if batch.has_times:
        rows = seq[SEQ_ITEM].values().numel()
        if tuple(batch.timestamps.shape) != (rows,) or tuple(batch.request_times.shape) != (b,):
            raise ValueError(
                f"times: timestamps {tuple(batch.timestamps.shape)} and request_times {tuple(batch.request_times.shape)}, "
                f"expected one per history item ({rows},) and one per sample ({b},)"
            )
        if batch.timestamps.is_floating_point() or batch.request_times.is_floating_point():
            raise ValueError("times: timestamps and request_times must be integers (seconds)")
    if not bool(torch.isfinite(batch.dense).all()):
        raise ValueError("dense features contain NaN or Inf")
