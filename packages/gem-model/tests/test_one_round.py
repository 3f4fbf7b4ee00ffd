"""Discoverable options: every problem of a command line in one round, the valid keys of an unknown
one, each component's options in `gem-train plugins --options` and filled in by `gem-train config`."""

from __future__ import annotations

import pytest

from gem_model.cli import main


@pytest.fixture
def inline_env(monkeypatch):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")


def test_mistakes_of_every_kind_come_back_together(capsys, inline_env, tiny_overrides, tmp_path):
    argv = [
        "run", "--nproc", "2", *tiny_overrides, "parallel.planner=inline_replicated",
        "model.num_heads=0",                  # schema
        "comm.strategy=pigeon",               # an unknown name
        "kernels.norm_gate.options.eps=3",    # an option the component does not have
        "model.max_seq_len=8",                # a constraint against the data (histories of 15)
        "--max-restarts", "-1",               # a launch option
    ]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.num_heads: Input should be greater than or equal to 1" in err
    assert "comm.strategy: unknown comm strategy 'pigeon'" in err
    assert "kernels.norm_gate.options.eps: Extra inputs are not permitted; valid keys here: (none)" in err
    assert "model.max_seq_len" in err and "it must be at least 16" in err
    assert "--max-restarts" in err
    assert not (tmp_path / "gem-tiny").exists()


def test_a_constraint_on_a_refused_field_is_not_reported_twice(capsys, inline_env, tiny_overrides):
    assert main(["run", *tiny_overrides, "model.num_heads=0", "model.embedding_dim=33"]) == 2
    err = capsys.readouterr().err
    assert err.count("model.num_heads") == 1  # the schema's, not also "must divide model.embedding_dim"


def test_an_unknown_key_lists_the_valid_ones(capsys, inline_env, tiny_overrides):
    assert main(["config", *tiny_overrides, "model.num_blok=3", "data.source.options.num_itemz=5"]) == 2
    err = capsys.readouterr().err
    assert "model.num_blok: Extra inputs are not permitted; valid keys here: alpha," in err
    assert "(did you mean 'num_blocks'?)" in err
    assert "data.source.options.num_itemz: Extra inputs are not permitted; valid keys here:" in err
    assert "num_items" in err.split("num_itemz")[1] and "zipf_exponent" in err.split("num_itemz")[1]


def test_plugins_options_shows_each_components_options(capsys, inline_env):
    assert main(["plugins", "--options"]) == 0
    out = capsys.readouterr().out
    assert "num_items (int, default 20000)" in out
    assert "zipf_exponent (float, default 1.05)" in out
    assert "columns.history_item (str, default 'history_item')" in out  # the parquet source's nested options
    assert "path (str, required): a .parquet file" in out
    assert "(no options)" in out
    assert main(["plugins"]) == 0
    assert "zipf_exponent" not in capsys.readouterr().out  # only on request


def test_config_prints_every_components_options_filled_in(capsys, inline_env, tiny_overrides):
    assert main(["config", "--only", "config", *tiny_overrides]) == 0
    out = capsys.readouterr().out
    source = out.split("source:", 1)[1].split("balancer:", 1)[0]
    assert "zipf_exponent: 1.05" in source and "max_len: 15" in source  # a default and an override
