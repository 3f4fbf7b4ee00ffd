"""The batch type every data source produces, and the feature spec the model is built from."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gem_model._deps import import_torchrec

import_torchrec()  # gem_model's first torchrec import: a broken fbgemm-gpu fails here with the fix named
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

# Keys of the sequence KJT. All item-valued keys are looked up in the one item table.
SEQ_ITEM = "seq_item"
SEQ_ACTION = "seq_action"
NEG_ITEM = "neg_item"
CAND_ITEM = "cand_item"
SEQUENCE_KEYS = (SEQ_ITEM, SEQ_ACTION, NEG_ITEM, CAND_ITEM)
ITEM_TABLE = "item"
ACTION_TABLE = "action"


POOLINGS = ("sum", "mean")


@dataclass(frozen=True)
class PooledFeature:
    """A non-sequence categorical feature with its own table.

    A sample may carry any number of ids of the feature (a bag, possibly empty); their embeddings are
    pooled by ``pooling``: ``"sum"`` or ``"mean"`` (an empty bag pools to zeros either way).
    """

    name: str
    num_embeddings: int
    pooling: str = "sum"

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooled feature {self.name!r}: pooling {self.pooling!r} is not one of {POOLINGS}")


@dataclass(frozen=True)
class FeatureSpec:
    """What a data source produces; the model's tables and heads are sized from it."""

    num_items: int
    num_actions: int
    pooled: tuple[PooledFeature, ...]
    num_dense: int
    tasks: tuple[str, ...]
    num_negatives: int
    max_history: int
    negatives_per_position: bool = False
    """False: ``num_negatives`` per sample, shared by its positions; True: ``num_negatives`` for each
    predicted position (each history position but the last), laid out position by position."""
    candidates: bool = True
    """Whether every sample carries one ``cand_item`` (``model.use_candidate`` needs it)."""
    timestamps: bool = True
    """Whether batches carry ``timestamps`` and ``request_times`` (``model.relative_time_bias`` needs them)."""

    def negatives_of(self, history_lengths: torch.Tensor) -> torch.Tensor:
        """How many negatives each sample carries, given its history lengths."""
        if self.negatives_per_position:
            return torch.clamp(history_lengths - 1, min=0) * self.num_negatives
        return torch.full_like(history_lengths, self.num_negatives)

    def table_of(self, feature: str) -> tuple[str, int]:
        """(table name, number of rows) that ``feature`` is looked up in."""
        if feature in (SEQ_ITEM, NEG_ITEM, CAND_ITEM):
            return ITEM_TABLE, self.num_items
        if feature == SEQ_ACTION:
            return ACTION_TABLE, self.num_actions
        for p in self.pooled:
            if p.name == feature:
                return f"t_{p.name}", p.num_embeddings
        raise KeyError(f"feature {feature!r} is not in the feature spec")


@dataclass
class Batch:
    """One rank's share of a global batch.

    ``sequence`` holds ``seq_item``/``seq_action`` (the user's history, jagged, possibly empty),
    ``neg_item`` (sampled negatives for the next-item loss, ``num_negatives`` per sample) and
    ``cand_item`` (the candidate item, 0 or 1 per sample). ``pooled`` holds the non-sequence
    categorical features. ``labels`` is ``[B, num_tasks]`` in {0, 1}.

    Optional times (integer seconds; empty when the source has none): ``timestamps`` holds the time
    of each history item (the values layout of ``seq_item``), ``request_times`` ``[B]`` the time of
    the action the sample predicts after its history (the request time of a recommendation).

    ``host_lengths``: the sequence KJT's lengths (every key's, key by key) on the host. A batch moved
    off the CPU keeps its CPU lengths here, so that the model can size and plan jagged work without
    reading lengths back from the device (each read is a host sync that idles the GPU).
    """

    sequence: KeyedJaggedTensor
    pooled: KeyedJaggedTensor
    dense: torch.Tensor
    labels: torch.Tensor
    sample_ids: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    timestamps: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    request_times: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))
    host_lengths: torch.Tensor | None = None
    lookup_sequence: KeyedJaggedTensor | None = None
    """``sequence`` as the model's table lookup takes it (its ids in even bags,
    :mod:`gem_model.model.lookup_bags`), attached on the device by the model's ``prepare_table_inputs``
    for a pipeline that starts the lookup's input distribution ahead of the forward; else None."""

    @property
    def has_times(self) -> bool:
        return self.request_times.numel() > 0 or self.timestamps.numel() > 0

    @property
    def batch_size(self) -> int:
        return int(self.dense.shape[0])

    def history_lengths(self) -> torch.Tensor:
        return self.sequence[SEQ_ITEM].lengths()

    def lengths_on_host(self, key: str) -> torch.Tensor | None:
        """The lengths of ``key`` of the sequence KJT as a CPU tensor, or ``None`` if only the device
        has them (a batch built on a device)."""
        lengths = self._host()
        if lengths is None:
            return None
        b = self.batch_size
        i = list(self.sequence.keys()).index(key)
        return lengths[i * b : (i + 1) * b]

    def _host(self) -> torch.Tensor | None:
        if self.host_lengths is not None:
            return self.host_lengths
        lengths = self.sequence.lengths()
        return lengths if lengths.device.type == "cpu" else None

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(
            sequence=kjt_to(self.sequence, device, non_blocking),
            pooled=kjt_to(self.pooled, device, non_blocking),
            dense=self.dense.to(device, non_blocking=non_blocking),
            labels=self.labels.to(device, non_blocking=non_blocking),
            sample_ids=self.sample_ids.to(device, non_blocking=non_blocking),
            timestamps=self.timestamps.to(device, non_blocking=non_blocking),
            request_times=self.request_times.to(device, non_blocking=non_blocking),
            host_lengths=self._host(),
        )

    def pin_memory(self) -> Batch:
        """A copy in page-locked memory, so that a ``to(cuda, non_blocking=True)`` of it runs asynchronously."""
        return Batch(
            sequence=kjt_pin(self.sequence),
            pooled=kjt_pin(self.pooled),
            dense=self.dense.pin_memory(),
            labels=self.labels.pin_memory(),
            sample_ids=self.sample_ids.pin_memory(),
            timestamps=self.timestamps.pin_memory(),
            request_times=self.request_times.pin_memory(),
            host_lengths=self._host(),
        )


def _host_splits(kjt: KeyedJaggedTensor) -> dict[str, list[int]]:
    """The per-key lengths and offsets of a KJT on the host, for the KJT made from it elsewhere.

    A device KJT without them reads its lengths back to the host (a device sync) the first time it
    is split by key (``kjt[key]``, ``to_dict()``, every embedding lookup). Plain ints point at no
    device, so they are safe to carry over; on a non-CPU KJT computing them would itself sync.
    """
    if kjt.values().device.type != "cpu":
        return {}
    return {"length_per_key": kjt.length_per_key(), "offset_per_key": kjt.offset_per_key()}


def kjt_to(kjt: KeyedJaggedTensor, device: torch.device, non_blocking: bool = False) -> KeyedJaggedTensor:
    """A new KJT on ``device`` built from the raw tensors (and the per-key splits of a host KJT).

    ``KeyedJaggedTensor.to`` in some torchrec versions carries over caches (e.g. the dict of
    per-key jagged tensors made by an earlier ``to_dict()``) that still point at the old device.
    """
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values().to(device, non_blocking=non_blocking),
        weights=weights.to(device, non_blocking=non_blocking) if weights is not None else None,
        lengths=kjt.lengths().to(device, non_blocking=non_blocking),
        offsets=kjt.offsets().to(device, non_blocking=non_blocking),
        **_host_splits(kjt),
    )


def kjt_pin(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """A new KJT in page-locked memory: every tensor :func:`kjt_to` copies (``KeyedJaggedTensor.pin_memory``
    leaves out offsets it has not computed yet, which the copy would then read from pageable memory)."""
    weights = kjt.weights_or_none()
    return KeyedJaggedTensor(
        keys=kjt.keys(),
        values=kjt.values().pin_memory(),
        weights=weights.pin_memory() if weights is not None else None,
        lengths=kjt.lengths().pin_memory(),
        offsets=kjt.offsets().pin_memory(),
        **_host_splits(kjt),
    )


def build_batch(
    *,
    history: list[torch.Tensor] | tuple[torch.Tensor, torch.Tensor],
    actions: torch.Tensor,
    negatives: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    candidates: torch.Tensor | None,
    pooled: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]],
    dense: torch.Tensor,
    labels: torch.Tensor,
    sample_ids: torch.Tensor | None = None,
    times: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Batch:
    """Assemble a :class:`Batch` from flat tensors.

    ``history`` is ``(values, lengths)`` of the item ids; ``actions`` has the same values layout;
    ``negatives`` is ``[B, K]`` (per sample) or ``(values, lengths)`` (any number per sample, e.g. K per
    predicted position); ``candidates`` is ``[B]`` or None. A pooled feature is either ``[B]``
    (one id per sample) or ``(values, lengths)`` with ``lengths`` ``[B]`` (a bag of ids per sample).
    ``times`` is ``(timestamps, request_times)`` (see :class:`Batch`) or None.
    """
    values, lengths = history
    b = int(lengths.numel())
    if isinstance(negatives, tuple):
        neg_values, neg_lengths = negatives
    else:
        k = negatives.shape[1] if negatives.numel() else 0
        neg_values, neg_lengths = negatives.reshape(-1), torch.full((b,), k, dtype=torch.long)
    cand_vals = candidates if candidates is not None else torch.empty(0, dtype=torch.long)
    cand_lens = torch.ones(b, dtype=torch.long) if candidates is not None else torch.zeros(b, dtype=torch.long)
    sequence = KeyedJaggedTensor.from_lengths_sync(
        keys=list(SEQUENCE_KEYS),
        values=torch.cat([values, actions, neg_values, cand_vals]).long(),
        lengths=torch.cat([lengths, lengths, neg_lengths, cand_lens]).long(),
    )
    names = list(pooled)
    bags = [_as_bag(n, pooled[n], b) for n in names]
    pooled_kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=names,
        values=torch.cat([v for v, _ in bags]).long() if names else torch.empty(0, dtype=torch.long),
        lengths=torch.cat([n for _, n in bags]).long() if names else torch.empty(0, dtype=torch.long),
    )
    return Batch(
        sequence=sequence,
        pooled=pooled_kjt,
        dense=dense.float(),
        labels=labels.float(),
        sample_ids=sample_ids if sample_ids is not None else torch.arange(b),
        **({} if times is None else {"timestamps": times[0].long(), "request_times": times[1].long()}),
    )


def _as_bag(
    name: str, feature: torch.Tensor | tuple[torch.Tensor, torch.Tensor], batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, lengths) of one pooled feature given as ``[B]`` ids or as a ``(values, lengths)`` bag."""
    if isinstance(feature, tuple):
        values, lengths = feature
        values, lengths = values.reshape(-1), lengths.reshape(-1)
    else:
        values = feature.reshape(-1)
        lengths = torch.ones(values.numel(), dtype=torch.long)
    if lengths.numel() != batch_size or int(lengths.sum()) != values.numel():
        raise ValueError(
            f"pooled feature {name!r}: {lengths.numel()} lengths adding up to {int(lengths.sum())} for "
            f"{values.numel()} values; expected {batch_size} lengths (one per sample) that add up to the values"
        )
    return values, lengths
