"""The MovieLens-1M source with the model: the context token that carries side features, and the
real data (tests marked ``real_data`` are skipped only where its data package is missing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from movielens_cases import real_data
from pydantic import ValidationError

from gem_model.config import ModelConfig
from gem_model.config_io import load_config
from gem_model.data.batch import Batch, build_batch
from gem_model.data.movielens import MovieLensConfig, MovieLensSource
from gem_model.model.gem import GemModel, prepend_one
from gem_model.testing import LoopAttention, TorchNormGate

# ----------------------------------------------------------------------------- the context token option


def gem_model(src: MovieLensSource, **options) -> GemModel:
    cfg = ModelConfig(
        embedding_dim=8,
        num_blocks=1,
        num_heads=2,
        attention_dim=4,
        value_dim=4,
        max_seq_len=8,
        use_candidate=False,
        cross_layers=0,
        **options,
    )
    return GemModel(cfg, src.feature_spec(), attention=LoopAttention(), norm_gate=TorchNormGate())


def with_gender(batch: Batch, gender: list[int]) -> Batch:
    d = batch.pooled.to_dict()
    pooled = {k: (torch.tensor(gender) if k == "user_gender" else (v.values(), v.lengths())) for k, v in d.items()}
    jt = batch.sequence.to_dict()
    return build_batch(
        history=(jt["seq_item"].values(), jt["seq_item"].lengths()),
        actions=jt["seq_action"].values(),
        negatives=jt["neg_item"].values().reshape(batch.batch_size, -1),
        candidates=None,
        pooled=pooled,
        dense=batch.dense,
        labels=batch.labels,
    )


def test_prepend_one():
    values = torch.tensor([[1.0], [2.0], [3.0], [4.0], [5.0]])
    out, lengths = prepend_one(values, torch.tensor([2, 0, 3]), torch.tensor([[10.0], [20.0], [30.0]]))
    assert out.squeeze(1).tolist() == [10, 1, 2, 20, 30, 3, 4, 5] and lengths.tolist() == [3, 1, 4]


def test_side_features_reach_retrieval_only_through_the_context_token(source):
    src = source(side_features=True, num_negatives=4, max_len=7)
    batch = src.make_batch(0, 3, torch.arange(3))
    flipped = with_gender(batch, [1 - g for g in batch.pooled["user_gender"].values().tolist()])
    torch.manual_seed(0)
    plain = gem_model(src).eval()
    assert torch.equal(plain.user_embeddings(batch), plain.user_embeddings(flipped))  # the default: unchanged
    ctx = gem_model(src, context_token=True).eval()
    assert not torch.allclose(ctx.user_embeddings(batch), ctx.user_embeddings(flipped))
    a, b = ctx(batch), ctx(flipped)
    assert not torch.allclose(a.next_item_loss_sum, b.next_item_loss_sum)
    assert a.next_item_count == plain(batch).next_item_count  # the context token predicts nothing
    a.next_item_loss_sum.backward()
    assert ctx.context_proj.weight.grad.abs().sum() > 0
    assert ctx.sparse.ebc.embedding_bags["t_user_gender"].weight.grad.abs().sum() > 0


def test_context_token_gives_empty_histories_a_query_and_needs_room(source):
    src = source(side_features=True, num_negatives=2, max_len=7)
    model = gem_model(src, context_token=True).eval()
    batch = src.evaluation.eval_batch(torch.arange(2), "valid")
    empty = build_batch(
        history=(torch.empty(0, dtype=torch.long), torch.zeros(2, dtype=torch.long)),
        actions=torch.empty(0, dtype=torch.long),
        negatives=torch.zeros(2, 0, dtype=torch.long),
        candidates=None,
        pooled={k: (v.values(), v.lengths()) for k, v in batch.pooled.to_dict().items()},
        dense=torch.zeros(2, 0),
        labels=torch.zeros(2, 0),
    )
    query = model.user_embeddings(empty)
    assert torch.isfinite(query).all() and (query.norm(dim=1) > 0.99).all()
    with pytest.raises(ValueError, match=r"plus the context token \(1\)"):
        gem_model(source(side_features=True, max_len=8), context_token=True)
    with pytest.raises(ValueError, match="has none"):
        gem_model(source(max_len=4), context_token=True)
    with pytest.raises(ValidationError, match="context_token needs model.use_side_features"):
        ModelConfig(context_token=True, use_side_features=False)


# ----------------------------------------------------------------------------------------- real data


@real_data
def test_real_movielens_1m_matches_the_published_counts():
    src = MovieLensSource(MovieLensConfig(side_features=True))
    d = src.data
    counts = d.offsets[1:] - d.offsets[:-1]
    assert (d.num_users, d.num_items, d.items.numel()) == (6040, 3883, 1_000_209)
    assert d.items.unique().numel() == 3706 and int(counts.min()) == 20 and int(counts.max()) == 2314
    assert d.num_genres == 18 and d.user_vocab["user_gender"] == 2 and d.user_vocab["user_age"] == 7
    assert src.steps_per_epoch(128) == 48


CONFIGS = Path(__file__).resolve().parents[3] / "configs"


@real_data
@pytest.mark.parametrize("config", ["ml1m.yaml", "ml1m-gem.yaml"])
def test_two_training_steps_and_evaluation_on_a_slice_of_users(pm, tiny_overrides, tmp_path, config):
    """The repository's configs, shrunk: inline kernels on the CPU, 32 users, histories of 15, one block."""
    from gem_model.trainer import train

    small = [
        *tiny_overrides,  # inline plugins, output under tmp_path, batch 16, max_len 15, one block
        "trainer.device=cpu",
        "trainer.steps=2",
        "trainer.eval_every=1",
        "data.source.options.max_users=32",
        "data.source.options.max_eval_users=24",
        "data.source.options.eval_batch_size=16",
    ]
    cfg = load_config(str(CONFIGS / config), small)
    summary = train(cfg, pm)
    records = [json.loads(x) for x in (tmp_path / cfg.name / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    final = records[-1]
    keys = {f"{s}/{m}@{k}{u}" for s in ("valid", "test") for m in ("hr", "ndcg") for k in (10, 50) for u in ("", "_unfiltered")}
    assert set(final) == keys | {"step"} and set(summary.extra["eval"]) == keys
    assert all(0.0 <= final[k] <= 1.0 for k in keys) and final["test/hr@50"] >= final["test/hr@10"]
    assert any(r["step"] == 1 and "valid/hr@10" in r for r in records)  # the evaluation after step 1
