"""Malformed configs exit 2 with the dotted path and the bad value, before any process starts."""

from __future__ import annotations

import pytest

from gem_model.cli import main


@pytest.fixture
def inline_env(monkeypatch):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing,data_parallel_cases")


# (overrides, dotted path, the bad value as the error shows it)
MALFORMED = [
    (["trainer.steps=0"], "trainer.steps", 0),
    (["trainer.steps=-3"], "trainer.steps", -3),
    (["model.num_heads=3"], "model.num_heads", 3),  # does not divide embedding_dim 32
    (["model.embedding_dim=30", "model.num_heads=4"], "model.num_heads", 4),
    (["data.global_batch_size=15", "--nproc", "2", "parallel.planner=inline_dp"], "data.global_batch_size", 15),
    (["model.max_seq_len=15"], "model.max_seq_len", 15),  # the data's histories are 15 long, plus the candidate
    (["model.max_seq_len=16", "model.context_token=true"], "model.max_seq_len", 16),
    (["model.num_blocks=0"], "model.num_blocks", 0),
    (["model.num_heads=0"], "model.num_heads", 0),
    (["model.embedding_dim=-1"], "model.embedding_dim", -1),
    (["model.attention_dim=0"], "model.attention_dim", 0),
    (["model.dropout=1.0"], "model.dropout", 1.0),
    (["model.temperature=0"], "model.temperature", 0),
    (["model.max_attn_len=-1"], "model.max_attn_len", -1),
    (["model.table_init=gpu"], "model.table_init", "gpu"),
    (["data.global_batch_size=0"], "data.global_batch_size", 0),
    (["trainer.dense_lr=0"], "trainer.dense_lr", 0),
    (["trainer.sparse_optimizer=lamb"], "trainer.sparse_optimizer", "lamb"),
    (["trainer.log_every=0"], "trainer.log_every", 0),
    (["trainer.checkpoint_every=-1"], "trainer.checkpoint_every", -1),
    (["trainer.grad_clip=0"], "trainer.grad_clip", 0),
    (["trainer.device=tpu"], "trainer.device", "tpu"),
    (["trainer.time_limit_s=0"], "trainer.time_limit_s", 0),
    (["trainer.warmup_steps=-1"], "trainer.warmup_steps", -1),
    (["trainer.resume=maybe"], "trainer.resume", "maybe"),
    (["trainer.stepz=3"], "trainer.stepz", 3),
    (["data.source.options.max_len=0"], "data.source.options.max_len", 0),
    (["precision.activation_dtype=float8"], "precision.activation_dtype", "float8"),
]


@pytest.mark.parametrize(("overrides", "path", "value"), MALFORMED, ids=[" ".join(m[0]) for m in MALFORMED])
def test_malformed_config_exits_2_naming_path_and_value(capsys, inline_env, tiny_overrides, tmp_path, overrides, path, value):
    launch = [x for x in overrides if x.startswith("--") or x.isdigit()]
    assert main(["run", *launch, *tiny_overrides, *[x for x in overrides if x not in launch]]) == 2
    err = capsys.readouterr().err
    assert f"{path}: " in err and f"(got {value!r})" in err, err
    assert not (tmp_path / "gem-tiny").exists()  # nothing was started or written


def test_every_broken_constraint_is_reported_together(capsys, inline_env, tiny_overrides):
    assert main(["run", *tiny_overrides, "model.num_heads=3", "model.max_seq_len=8"]) == 2
    err = capsys.readouterr().err
    assert "model.num_heads: must divide model.embedding_dim (32)" in err
    assert "model.max_seq_len: is shorter than the data's longest history (15" in err and "at least 16" in err
