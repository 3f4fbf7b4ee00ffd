"""A checkpoint of another width, table size or batch exits 2 naming the first mismatched tensors,
both shapes and the config fields that differ; it loads in part only with trainer.resume_partial."""

from __future__ import annotations

import json

import pytest
import torch

from gem_model import testing
from gem_model.cli import main
from gem_model.config_io import load_config
from gem_model.distributed import init_distributed
from gem_model.errors import CheckpointError
from gem_model.layout import Layout
from gem_model.resolve import resolve_components
from gem_model.train import reshard
from gem_model.train.run import Run
from gem_model.trainer import train

ITEMS = "data.source.options.num_items=500"


@pytest.fixture
def saved(pm, tiny_overrides, tmp_path):
    """A run of 2 steps whose last checkpoint is step 2 (500 items, width 32, global batch 16)."""
    train(load_config(None, [*tiny_overrides, ITEMS, "trainer.steps=2"]), pm)
    return tmp_path / "gem-tiny" / "checkpoints" / "step_00000002"


def resumed(tiny_overrides, *changed: str) -> list[str]:
    return ["run", *tiny_overrides, ITEMS, "trainer.steps=4", "trainer.resume=true", *changed]


@pytest.mark.parametrize(
    ("changed", "tensor", "field"),
    [
        (("model.embedding_dim=16", "model.attention_dim=8", "model.value_dim=8"),
         "model.sparse.ec.embeddings.item.weight (checkpoint [500, 32], this run [500, 16])",
         "model.attention_dim (16 -> 8), model.embedding_dim (32 -> 16), model.value_dim (16 -> 8)"),
        (("data.source.options.num_items=600",),
         "model.sparse.ec.embeddings.item.weight (checkpoint [500, 32], this run [600, 32])", "data.source.options.num_items (500 -> 600)"),
        (("data.global_batch_size=8",),
         "loader.global_batch_size (checkpoint 16, this run 8)", "data.global_batch_size (16 -> 8)"),
    ],
)  # fmt: skip
def test_an_incompatible_checkpoint_exits_2_naming_tensors_shapes_and_fields(
    saved, tiny_overrides, monkeypatch, capsys, changed, tensor, field
):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    before = testing.checkpoint_tensors(saved)
    assert main(resumed(tiny_overrides, *changed)) == 2
    err = capsys.readouterr().err
    assert "IncompatibleCheckpointError" in err and "Traceback" not in err, err
    assert f"{saved} does not fit this run (nothing was loaded)" in err
    assert tensor in err and f"The config fields that differ: {field}" in err
    assert "trainer.resume_partial=true" in err
    after = testing.checkpoint_tensors(saved)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_auto_resume_refuses_another_runs_checkpoint_with_exit_2_and_its_shapes(saved, tiny_overrides, monkeypatch, capsys):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    args = [a for a in resumed(tiny_overrides, "data.source.options.num_items=600") if a != "trainer.resume=true"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "holds checkpoints of another run (step_00000002)" in err and "num_items (500 -> 600)" in err
    assert "Its model: 1 tensor(s) differ" in err and "[500, 32], this run [600, 32]" in err


def test_resume_partial_loads_what_fits_and_keeps_the_rest_fresh(saved, pm, tiny_overrides, capsys):
    config = load_config(None, resumed(tiny_overrides, "data.source.options.num_items=600", "trainer.resume_partial=true")[1:])
    run = Run(config, pm, resolve_components(config, pm), init_distributed("cpu"))
    run.feed.close()  # only its loaded state is looked at
    out = capsys.readouterr().out
    assert "trainer.resume_partial: loaded" in out and "[500, 32], this run [600, 32]" in out
    saved_tensors = testing.checkpoint_tensors(saved)
    state = run.prepared.module.state_dict()
    table = next(k for k in state if k.endswith("ec.embeddings.item.weight"))
    assert state[table].shape == (600, 32)  # the fresh table, of this run's size
    assert not torch.equal(state[table][:500], saved_tensors[f"model.{table}"])
    dense = [k for k in state if k != table]
    assert dense and all(torch.equal(state[k], saved_tensors[f"model.{k}"]) for k in dense)
    assert run.start_step == 2  # the data position came with it


def test_a_layout_that_partitions_the_model_differently_cannot_reshard(saved):
    """A tensor-parallel checkpoint of 2 ranks (its meta as a tp=2 run writes it) at 1 process."""
    meta = {**json.loads((saved / "meta.json").read_text()), "world_size": 2, "layout": {"degrees": {"tp": 2}, "world_size": 2}}
    with pytest.raises(CheckpointError) as info:
        reshard.check(saved, meta, Layout.data_parallel(rank=0, world_size=1))
    message = str(info.value)
    assert f"{saved} was written by 2 processes" in message and "this run's 1 (layout {'dp_replicate': 1})" in message
    assert "the degree(s) tp (2 -> 1) partition the model itself" in message
    reshard.check(saved, {**meta, "layout": {"degrees": {"dp_replicate": 2}}}, Layout.data_parallel(rank=0, world_size=1))
