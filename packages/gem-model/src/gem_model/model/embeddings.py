"""The sparse arch: torchrec tables built from the data source's feature spec.

Sequence features (history items, actions, negatives, the candidate) go through one
``EmbeddingCollection`` (unpooled, jagged); non-sequence categorical features through an
``EmbeddingBagCollection`` (each feature sum- or mean-pooled, as its spec says). A parallel planner
may shard both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from gem_model.data.batch import ACTION_TABLE, CAND_ITEM, ITEM_TABLE, NEG_ITEM, SEQ_ACTION, SEQ_ITEM, FeatureSpec
from gem_model.model.lookup_bags import even_bags, lengths_by_key
from gem_model.table_grad import table_views

_POOLING = {"sum": PoolingType.SUM, "mean": PoolingType.MEAN}

ONE_GRADIENT_BUFFER = True
"""The sequence lookup's rows reach the model as views of one gradient buffer (:mod:`gem_model.table_grad`):
the kernels that consume them (the sequence input, the next-item loss) write their gradients into it, and
neither torch's split backward (a copy of every row's gradient) nor the add of the items' two gradients
runs. On the H100's big config (2026-12-07, ``benchmarks/table_grad.py``) the two kernels and the lookup's
gradient took 9.439 ms against 10.144 (1.075x), the same bits; the step 1.003-1.006x (two seeds, paired and
steady; ``benchmarks/results/e2e_ab.md``), peak memory +0.5 GiB. False: one :func:`table_output` per feature,
autograd's split backward and adds, as before (e2e switch ``table_grads_by_feature``). Read at each forward."""


class _TableOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float, gate: Callable[[], None] | None) -> torch.Tensor:  # type: ignore[override]
        ctx.scale, ctx.gate = scale, gate
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        if ctx.gate is not None:
            ctx.gate()  # may raise: then no gradient reaches the tables
        return (grad if ctx.scale == 1.0 else grad * ctx.scale), None, None


def table_output(x: torch.Tensor, scale: float, gate: Callable[[], None] | None = None) -> torch.Tensor:
    """Identity forward on a table's output; in backward calls ``gate()`` first (before the gradient
    goes on to the table, whose update torchrec fuses into the lookup's backward), then multiplies the
    gradient by ``scale``."""
    return x if scale == 1.0 and gate is None else _TableOutput.apply(x, scale, gate)


def tiling(values: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]] | None:
    """The one tensor ``values`` are row slices of, tiling it (contiguous, back to back, every row once),
    and the order in which they lie there; None if they are anything else. torchrec's lookups hand back
    their output split per feature (``torch.split``), which this recognises."""
    base = values[0]._base if values else None
    if base is None or base.dim() != 2 or not base.is_contiguous() or not base.requires_grad:
        return None
    row = base.stride(0)
    for v in values:
        if v._base is not base or v.dim() != 2 or v.shape[1] != base.shape[1] or not v.is_contiguous():
            return None
        if (v.storage_offset() - base.storage_offset()) % row:
            return None
    start = [(v.storage_offset() - base.storage_offset()) // row for v in values]
    order = sorted(range(len(values)), key=lambda i: (start[i], values[i].shape[0] > 0))  # an empty one fits anywhere
    end = 0
    for i in order:
        if values[i].shape[0] and start[i] != end:
            return None
        end += values[i].shape[0]
    return (base, order) if end == base.shape[0] else None


def table_bound(rows: int) -> float:
    """The uniform init's bound of a table with ``rows`` rows."""
    return (1.0 / rows) ** 0.5 if rows < 100 else 0.05


class SparseArch(nn.Module):
    """Embedding lookups. ``grad_scale`` is set by a planner whose table gradients are summed over ranks.

    ``lookup_bags_per_sample``: the sequence features go to the lookup re-split into this many even bags
    per sample (:mod:`gem_model.model.lookup_bags`); ``None`` looks them up in the batch's own bags.
    """

    def __init__(
        self,
        spec: FeatureSpec,
        dim: int,
        *,
        seed: int = 0,
        sequence_init_std: float | None = None,
        on_meta: bool = False,
        lookup_bags_per_sample: int | None = None,
    ):
        super().__init__()
        self.spec = spec
        self.grad_scale = 1.0
        self.grad_gate: Callable[[], None] | None = None  # GemModel.set_table_grad_gate
        self.lookup_bags_per_sample = lookup_bags_per_sample
        self.on_meta = on_meta
        if on_meta and sequence_init_std is not None:
            raise ValueError(
                "model.table_init 'device' draws the tables uniformly on the device; it cannot take "
                "model.embedding_init_std (a normal init drawn on the host)"
            )
        device = torch.device("meta") if on_meta else None

        def bounds(rows: int) -> dict[str, float]:  # the host init's bounds, for a planner drawing on device
            bound = table_bound(rows)
            return {"weight_init_min": -bound, "weight_init_max": bound}

        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=ITEM_TABLE,
                    embedding_dim=dim,
                    num_embeddings=spec.num_items,
                    feature_names=[SEQ_ITEM, NEG_ITEM, CAND_ITEM],
                    **bounds(spec.num_items),
                ),
                EmbeddingConfig(
                    name=ACTION_TABLE,
                    embedding_dim=dim,
                    num_embeddings=spec.num_actions,
                    feature_names=[SEQ_ACTION],
                    **bounds(spec.num_actions),
                ),
            ],
            device=device,
        )
        self.ebc = (
            EmbeddingBagCollection(
                tables=[
                    EmbeddingBagConfig(
                        name=f"t_{p.name}",
                        embedding_dim=dim,
                        num_embeddings=p.num_embeddings,
                        feature_names=[p.name],
                        pooling=_POOLING[p.pooling],
                        **bounds(p.num_embeddings),
                    )
                    for p in spec.pooled
                ],
                device=device,
            )
            if spec.pooled
            else None
        )
        self.sequence_init_std = sequence_init_std
        if not on_meta:
            self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        # Seeded and independent of the global RNG, so every world size starts from the same tables.
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if self.sequence_init_std is not None and name.startswith("ec."):
                    p.copy_(torch.empty(p.shape).normal_(0.0, self.sequence_init_std, generator=g))
                    continue
                bound = table_bound(p.shape[0])
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=g))

    def materialize_on(self, device: torch.device, seed: int) -> None:
        """Allocate meta-device tables on ``device`` and draw them there (``table_init: device``)."""
        g = torch.Generator(device=device).manual_seed(seed + 1)
        self.to_empty(device=device)
        with torch.no_grad():
            for _, p in sorted(self.named_parameters()):
                bound = table_bound(p.shape[0])
                p.uniform_(-bound, bound, generator=g)
        self.on_meta = False

    def forward(
        self, sequence: KeyedJaggedTensor, pooled: KeyedJaggedTensor
    ) -> tuple[dict[str, JaggedTensor], dict[str, torch.Tensor]]:
        bags = self.lookup_bags_per_sample
        # a pipelined table (trainer.pipeline sparse_dist) looks up what torchrec distributed ahead, whatever
        # it is given here: batch.lookup_sequence, which GemModel.prepare_table_inputs attached
        pipelined = getattr(self.ec, "is_pipelined", False)
        looked_up = self.ec(sequence if bags is None or pipelined else even_bags(sequence, bags))
        lengths = lengths_by_key(sequence)  # the batch's own bags: the lookup's may be re-split
        values = self._sequence_values({k: jt.values() for k, jt in looked_up.items()})
        seq = {k: JaggedTensor(values=v, lengths=lengths[k]) for k, v in values.items()}
        pooled_out: dict[str, torch.Tensor] = {}
        if self.ebc is not None:
            pooled_out = {k: table_output(v, self.grad_scale, self.grad_gate) for k, v in self.ebc(pooled).to_dict().items()}
        return seq, pooled_out

    def _sequence_values(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The sequence features' rows as the model reads them: views of one gradient buffer
        (:data:`ONE_GRADIENT_BUFFER`; :func:`gem_model.table_grad.grad_section` gives each one's section) where
        the lookup's output is one tensor they tile, else each through :func:`table_output`."""
        tiled = tiling(list(values.values())) if ONE_GRADIENT_BUFFER else None
        if tiled is None:
            return {k: table_output(v, self.grad_scale, self.grad_gate) for k, v in values.items()}
        base, order = tiled
        names = list(values)
        keys = [names[i] for i in order]
        views = table_views(base, [values[k].shape[0] for k in keys], self.grad_gate, self.grad_scale)
        by_key = dict(zip(keys, views, strict=True))
        return {k: by_key[k] for k in values}

    def item_table(self) -> torch.Tensor:
        """The item table's weights (unsharded runs only; used by full-catalogue evaluation)."""
        return self.ec.embeddings[ITEM_TABLE].weight
