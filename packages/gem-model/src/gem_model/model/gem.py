"""The GEM model, assembled from registry components.

Data flow of :meth:`GemModel.forward`::

    sequence KJT --EmbeddingCollection--> item + action (+ position) embeddings, jagged [L, D]
        (+ with ``context_token``, the non-sequence tower's summary prepended to each sequence)
        (+ the candidate item appended to each sequence as a target)
        --HSTU blocks--> per-position outputs
           |-> next-item sampled softmax (history positions predict the following item)
           '-> sequence summary (candidate / last position) + mean of the history
    pooled KJT --EmbeddingBagCollection--> feature tokens, + a token of the dense features
        --token mixer (non-sequence interaction)--> feature tokens
    [summary, mean, feature tokens] --cross layers--> task heads (multi-task BCE)

The model returns loss *sums* and counts; the trainer normalises them by global counts, so the loss
of a data-parallel run equals the loss of the same global batch on one process.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from gem_model.components import (
    JaggedAttentionKernel,
    NextItemLossKernel,
    NormGateKernel,
    SequenceInputKernel,
    SequencePoolKernel,
)
from gem_model.config import ModelConfig
from gem_model.data.batch import CAND_ITEM, NEG_ITEM, SEQ_ACTION, SEQ_ITEM, Batch, FeatureSpec
from gem_model.jagged import append_one, offsets_of, prepend_one
from gem_model.model.dense_init import init_dense
from gem_model.model.embeddings import SparseArch
from gem_model.model.hstu import HSTUBlock, LayerNorm, TokenMixer
from gem_model.model.next_item import TorchNextItemLoss
from gem_model.model.sequence_input import TorchSequenceInput
from gem_model.model.sequence_pool import TorchSequencePool
from gem_model.model.tables_view import ShardableTables


def check_model(config: ModelConfig, spec: FeatureSpec, attention: JaggedAttentionKernel) -> None:
    """Raise ``ValueError`` when ``config`` cannot be built on data of ``spec`` with ``attention``, naming the
    setting and what it needs."""
    extra = 1 if config.use_candidate else 0
    lead = 1 if config.context_token else 0
    if spec.max_history + extra + lead > config.max_seq_len:
        raise ValueError(
            f"model.max_seq_len {config.max_seq_len} is shorter than the data's longest history "
            f"({spec.max_history}) plus the candidate ({extra}) plus the context token ({lead})"
        )
    for setting, wanted, supported in (("relative_position_bias", config.relative_position_bias,
                                        attention.supports_position_bias),
                                       ("relative_time_bias", config.relative_time_bias, attention.supports_time_bias)):
        if wanted and not supported:
            raise ValueError(
                f"model.{setting} needs an attention kernel that supports it; kernels.jagged_attention "
                f"{attention.name!r} does not (gem-kernels' 'torch' and 'triton' do)"
            )


class ModelOutput(NamedTuple):
    task_logits: torch.Tensor  # [B, num_tasks]
    task_loss_sum: torch.Tensor  # sum over samples of the mean BCE over tasks
    next_item_loss_sum: torch.Tensor  # sum over predicted positions of the sampled-softmax loss
    next_item_count: torch.Tensor  # number of predicted positions


class GemModel(ShardableTables):
    def __init__(
        self,
        config: ModelConfig,
        spec: FeatureSpec,
        *,
        attention: JaggedAttentionKernel,
        norm_gate: NormGateKernel,
        next_item_loss: NextItemLossKernel | None = None,
        sequence_pool: SequencePoolKernel | None = None,
        sequence_input: SequenceInputKernel | None = None,
        seed: int = 0,
    ):
        """``attention``, ``norm_gate``, ``next_item_loss``, ``sequence_pool`` and ``sequence_input``: the
        run's kernels of those ops (``kernels.<op>``); the last three None: the core's
        :class:`TorchNextItemLoss`, :class:`TorchSequencePool`, :class:`TorchSequenceInput`."""
        super().__init__()
        self.config, self.spec, self.seed = config, spec, seed
        self.loss_kernel: NextItemLossKernel = next_item_loss if next_item_loss is not None else TorchNextItemLoss()
        self.pool_kernel: SequencePoolKernel = sequence_pool if sequence_pool is not None else TorchSequencePool()
        self.input_kernel: SequenceInputKernel = sequence_input if sequence_input is not None else TorchSequenceInput()
        check_model(config, spec, attention)
        d = config.embedding_dim
        self.sparse = SparseArch(
            spec,
            d,
            seed=seed,
            sequence_init_std=config.embedding_init_std,
            on_meta=config.table_init == "device",
            lookup_bags_per_sample=config.lookup_bags_per_sample,
        )
        self.position = nn.Embedding(config.max_seq_len, d) if config.position_embedding else None
        alpha = config.alpha if config.alpha is not None else config.attention_dim**-0.5
        self.blocks = nn.ModuleList(
            HSTUBlock(
                dim=d,
                num_heads=config.num_heads,
                attention_dim=config.attention_dim,
                value_dim=config.value_dim,
                max_seq_len=config.max_seq_len,
                max_attn_len=config.max_attn_len,
                alpha=alpha,
                dropout=config.dropout,
                attention=attention,
                norm_gate=norm_gate,
                position_bias=config.relative_position_bias,
                time_buckets=config.time_bias_buckets if config.relative_time_bias else 0,
            )
            for _ in range(config.num_blocks)
        )
        self.seq_norm = LayerNorm(d)
        self.input_dropout = nn.Dropout(config.dropout)
        side = config.use_side_features
        self.dense_proj = nn.Linear(spec.num_dense, d) if side and spec.num_dense else None
        self.interaction = nn.ModuleList(
            TokenMixer(d, config.num_heads, config.dropout) for _ in range(config.interaction_layers if side else 0)
        )
        self.cross = nn.ModuleList(TokenMixer(d, config.num_heads, config.dropout) for _ in range(config.cross_layers))
        self.num_tokens = 2 + (self.num_feature_tokens() if side else 0)
        self.context_proj = None
        if config.context_token:
            if not side or self.num_feature_tokens() == 0:
                raise ValueError(
                    "model.context_token needs model.use_side_features and a data source with pooled or dense "
                    "features; this source has none"
                )
            self.context_proj = nn.Linear(self.num_feature_tokens() * d, d)
        self.task_head = (
            nn.Sequential(
                nn.Linear(self.num_tokens * d, config.mlp_hidden), nn.GELU(), nn.Linear(config.mlp_hidden, len(spec.tasks))
            )
            if spec.tasks
            else None
        )
        self.activation_dtype = torch.float32
        init_dense(self, config, seed)

    def set_activation_dtype(self, dtype: torch.dtype) -> None:
        """The dtype in which activations flow (:mod:`gem_model.precision`): the tables' outputs and
        the dense features are cast to it where they enter; losses stay float32."""
        if not dtype.is_floating_point:
            raise ValueError(f"model activation dtype must be a floating dtype, got {dtype}")
        self.activation_dtype = dtype

    def num_feature_tokens(self) -> int:
        return len(self.spec.pooled) + (1 if self.spec.num_dense else 0)

    def activation_blocks(self) -> list[str]:
        """Names of the modules an activation policy wraps."""
        return [f"blocks.{i}" for i in range(len(self.blocks))]

    # ------------------------------------------------------------------------------------ forward

    def _feature_tokens(self, batch: Batch, pooled: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
        """The non-sequence tower: pooled features (+ the dense token) after the interaction layers, ``[B, T, D]``."""
        feats = [pooled[p.name].to(dtype) for p in self.spec.pooled]
        if self.dense_proj is not None:
            feats.append(self.dense_proj(batch.dense.to(dtype)).to(dtype))
        if not feats:
            return None
        f = torch.stack(feats, 1)
        for layer in self.interaction:
            f = layer(f)
        return f

    def _history_times(self, batch: Batch, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(key, query)`` timestamps of the history rows: an item's own time, and the time of the action
        its position predicts (the next item's, the request time at the last position)."""
        if not batch.has_times:
            raise ValueError(
                "model.relative_time_bias needs timestamps in the batch (Batch.timestamps and request_times); "
                "this data source gives none"
            )
        key = batch.timestamps
        query = torch.cat([key[1:], key.new_zeros(min(1, key.numel()))])
        last = offsets_of(lengths)[1:] - 1
        has_any = lengths > 0
        return key, query.index_put((last[has_any],), batch.request_times[has_any])

    def encode(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Run the towers. Returns per-position sequence outputs and the sample-level tokens."""
        cfg = self.config
        seq, pooled = self.sparse(batch.sequence, batch.pooled)
        hist_lengths = seq[SEQ_ITEM].lengths()
        item_emb = seq[SEQ_ITEM].values()
        num_targets = None
        features = None
        context = None
        lead = 0  # rows before the history in each sequence: the context token
        times = self._history_times(batch, hist_lengths) if cfg.relative_time_bias else None
        if self.context_proj is not None:
            features = self._feature_tokens(batch, pooled, self.activation_dtype)
            assert features is not None  # checked in __init__
            context = self.context_proj(features.flatten(1))
            if times is not None:  # the context token's time: the first item's (the request time if none)
                nonempty = hist_lengths > 0
                first = batch.request_times.index_put((nonempty,), times[0][offsets_of(hist_lengths)[:-1][nonempty]])
                times = (prepend_one(times[0], hist_lengths, first)[0], prepend_one(times[1], hist_lengths, first)[0])
            lead = 1
        lengths = hist_lengths + lead if lead else hist_lengths
        candidates = None
        if cfg.use_candidate:
            cand = seq[CAND_ITEM]
            counts = batch.lengths_on_host(CAND_ITEM)  # on the host: no device sync for the check
            counts = cand.lengths() if counts is None else counts
            if int(counts.min()) != 1 or int(counts.max()) != 1:
                raise ValueError(f"model.use_candidate needs exactly one {CAND_ITEM!r} per sample")
            if times is not None:  # the candidate is asked about at the request time
                times = (append_one(times[0], lengths, batch.request_times)[0],
                         append_one(times[1], lengths, batch.request_times)[0])
            candidates = cand.values()
            lengths = lengths + 1
            num_targets = torch.ones_like(lengths)
        # the rows of each sequence: the context token, item + action of the history, the candidate,
        # each plus its position's row, in the activation dtype
        x = self.input_kernel(
            item_emb, seq[SEQ_ACTION].values(), hist_lengths,
            scale=cfg.embedding_dim**0.5 if cfg.scale_item_input else 1.0, first=context, last=candidates,
            position=None if self.position is None else self.position.weight, dtype=self.activation_dtype,
            max_len=cfg.max_seq_len,
        )  # fmt: skip
        offsets = offsets_of(lengths)
        x = self.input_dropout(x)
        for block in self.blocks:
            x = block(x, offsets, num_targets, times)
        # the final layer norm, the history rows, each sequence's last row and its history's mean
        norm = self.seq_norm
        hist_out, summary, mean = self.pool_kernel(
            x, norm.weight, norm.bias, norm.eps, offsets, hist_lengths,
            lead=lead, candidate=cfg.use_candidate, max_len=cfg.max_seq_len,
        )  # fmt: skip
        tokens = [summary, mean]
        if cfg.use_side_features:
            if features is None:  # computed after the sequence tower, as before context tokens existed
                features = self._feature_tokens(batch, pooled, x.dtype)
            if features is not None:
                tokens += list(features.unbind(1))
        return {
            "hist_out": hist_out,
            "hist_lengths": hist_lengths,
            "item_emb": item_emb,
            "neg_emb": seq[NEG_ITEM].values(),
            "tokens": torch.stack(tokens, 1),
            "summary": summary,
        }

    def forward(self, batch: Batch) -> ModelOutput:
        enc = self.encode(batch)
        t = enc["tokens"]
        for layer in self.cross:
            t = layer(t)
        zero = t.new_zeros((), dtype=torch.float32)
        if self.task_head is not None:
            logits = self.task_head(t.reshape(t.shape[0], -1)).float()
            task_loss = F.binary_cross_entropy_with_logits(logits, batch.labels, reduction="none").mean(1).sum()
        else:
            logits, task_loss = t.new_zeros(t.shape[0], 0), zero
        next_sum, next_count = self.next_item_loss(enc, batch)
        return ModelOutput(logits, task_loss, next_sum, next_count)

    def next_item_loss(self, enc: dict[str, torch.Tensor], batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled softmax: position i of a history predicts the item at i + 1 against negatives.

        The negatives are the sample's, shared by its positions, or with the spec's
        ``negatives_per_position`` each position's own; see :mod:`gem_model.model.next_item` for the
        math and the memory bound. Computed by :attr:`loss_kernel`, the run's ``kernels.next_item_loss``.
        """
        return self.loss_kernel(
            enc["hist_out"], enc["item_emb"], enc["neg_emb"], enc["hist_lengths"],
            batch.sequence[SEQ_ITEM].values(), batch.sequence[NEG_ITEM].values(),
            num_negatives=self.spec.num_negatives, per_position=self.spec.negatives_per_position,
            l2_normalize=self.config.l2_normalize, temperature=self.config.temperature,
            host_lengths=batch.lengths_on_host(SEQ_ITEM),
        )

    # ---------------------------------------------------------------------------------- retrieval

    @torch.no_grad()
    def user_embeddings(self, batch: Batch) -> torch.Tensor:
        """The query vector of each sample: the last history position's output (for retrieval).

        With ``context_token`` a sample with an empty history gets the context token's output.
        """
        enc = self.encode(batch)
        summary = enc["summary"].float()
        return F.normalize(summary, dim=-1, eps=1e-6) if self.config.l2_normalize else summary

    @torch.no_grad()
    def item_embeddings(self) -> torch.Tensor:
        w = self.sparse.item_table().float()
        return F.normalize(w, dim=-1, eps=1e-6) if self.config.l2_normalize else w

