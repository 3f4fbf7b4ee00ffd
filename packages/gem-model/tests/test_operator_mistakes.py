"""Operator mistakes answered before the run is built: exit 2, the field named, nothing written."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from movielens_cases import write_dataset

from gem_model import footprint, hookimpl, testing
from gem_model.cli import main
from gem_model.config_io import load_config
from gem_model.errors import ConfigError
from gem_model.trainer import train


class GroupedPlanner(testing.Replicated):
    """A planner that, like torchrec's sharded tables, needs a process group even at one process."""

    name: ClassVar[str] = "inline_grouped"
    needs_process_group: ClassVar[bool] = True


class GroupedPlugin:
    @hookimpl
    def gem_register_parallel_planners(self):
        return [GroupedPlanner]


@pytest.fixture
def inline_env(monkeypatch):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")


def run(capsys, *argv: str) -> str:
    assert main(["run", *argv]) == 2
    return capsys.readouterr().err


def test_a_planner_that_needs_a_process_group_in_a_plain_process_says_what_to_run(pm, tiny_overrides, tmp_path):
    pm.register(GroupedPlugin())
    with pytest.raises(ConfigError, match=r"parallel.planner: needs a process group.*torchrun --standalone"):
        train(load_config(None, [*tiny_overrides, "parallel.planner=inline_grouped"]), pm)
    assert not (tmp_path / "gem-tiny").exists()


def test_gem_train_run_starts_torchrun_for_such_a_planner_at_one_process(monkeypatch, capsys, tiny_overrides,
                                                                         torchrun_start):  # fmt: skip
    monkeypatch.setattr("gem_model.plugins.GemPluginManager._load_env_plugins",
                        lambda self: [self.register(m) for m in (testing, GroupedPlugin())])  # fmt: skip
    with pytest.raises(torchrun_start.started):
        main(["run", *tiny_overrides, "parallel.planner=inline_grouped"])
    ((argv, _),) = torchrun_start.calls
    assert argv[1:4] == ["-m", "torch.distributed.run", "--standalone"] and "--nproc-per-node=1" in argv
    assert "needs a process group: starting torchrun with one process" in capsys.readouterr().err


def test_cuda_on_a_machine_without_it(capsys, inline_env, tiny_overrides, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = run(capsys, *tiny_overrides, "trainer.device=cuda")
    assert "trainer.device: no CUDA device here" in err and "trainer.device=cpu" in err


def test_a_placeholder_typo_in_the_output_dir(capsys, inline_env, tiny_overrides, tmp_path):
    err = run(capsys, *tiny_overrides, f"trainer.output_dir={tmp_path}/{{nme}}")
    assert "trainer.output_dir" in err and "unknown placeholder {nme}; the placeholders are {name}" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("override", "path"),
    [("trainer.dense_lr=.inf", "trainer.dense_lr"), ("trainer.sparse_lr=.nan", "trainer.sparse_lr"),
     ("trainer.betas=[0.9, -.inf]", "trainer.betas.1"), ("data.source.options.zipf_exponent=.nan", "data.source.options.zipf_exponent")],
)  # fmt: skip
def test_no_infinity_or_nan_in_a_float(capsys, inline_env, tiny_overrides, override, path):
    assert f"{path}: Input should be a finite number" in run(capsys, *tiny_overrides, override)


def test_a_config_file_that_is_not_utf8(capsys, inline_env, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_bytes("name: caf\xe9\n".encode("latin-1"))
    err = run(capsys, "-c", str(config))
    assert f"<file>: is not UTF-8 text: byte 0xe9 at offset 9 (line 1); save the file as UTF-8 (got '{config}')" in err


def test_a_key_given_twice_in_yaml(capsys, inline_env, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("trainer:\n  steps: 5\n  log_every: 1\n  steps: 50\n")
    err = run(capsys, "-c", str(config))
    assert f"{config}: key 'steps' is given twice in one mapping (lines 2 and 4" in err


def test_data_without_the_candidate_the_model_asks_for(capsys, inline_env, tiny_overrides, tmp_path):
    folder = write_dataset(tmp_path / "ml")
    err = run(capsys, *tiny_overrides, "data.source=movielens_1m", f"data.source.options.data_dir={folder}",
              "model.use_side_features=false", "model.relative_time_bias=true")  # fmt: skip
    assert "model.use_candidate: data.source 'movielens_1m' gives no candidate item per sample" in err
    assert "model.use_candidate=false" in err
    assert "model.relative_time_bias" not in err  # movielens_1m has times


def test_data_without_the_times_or_side_features_the_model_asks_for(capsys, inline_env, tiny_overrides):
    err = run(capsys, *tiny_overrides, "model.relative_time_bias=true", "kernels.jagged_attention=loop")
    assert "model.relative_time_bias: needs each event's time, and data.source 'synthetic' gives none" in err


def test_tables_larger_than_the_memory(capsys, inline_env, tiny_overrides, tmp_path, monkeypatch):
    monkeypatch.setattr(footprint, "host_memory", lambda: 2e9)  # a 2 GB machine, whatever this one has
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = run(capsys, *tiny_overrides, "trainer.device=cpu", "data.source.options.num_users=100000000")
    assert "data.source: the run needs at least 13.2 GB per process, more than this host's available memory (2 GB)" in err
    assert "tables 12.8 GB on one process (the largest, t_user_id: 100,000,000 x 32)" in err
    assert not (tmp_path / "gem-tiny").exists()
    err = run(capsys, *tiny_overrides, "trainer.device=cpu", "model.embedding_dim=8192", "model.num_heads=64",
              "model.attention_dim=256", "model.value_dim=256")  # fmt: skip
    assert "model: the run needs at least" in err and "dense parameters, gradients and AdamW state" in err
    assert main(["run", *tiny_overrides, "trainer.device=cpu", "trainer.steps=1"]) == 0  # the tiny run fits in 2 GB


def test_the_estimate_stays_below_what_the_h200_measured():
    """The memory check is a lower bound: on configs/h200-large.yaml it must stay under the 77.9 GB
    peak the H200 profile measured (benchmarks/results/profile.md), or it would refuse a run that fits."""
    from gem_model.data.synthetic import SyntheticConfig, SyntheticSource

    config = load_config(Path(__file__).resolve().parents[3] / "configs" / "h200-large.yaml")
    source = SyntheticSource(SyntheticConfig(**config.data.source.options))
    first = source.lengths(0, config.data.global_batch_size)
    shape = footprint.MemoryShape(source.feature_spec(), 1, 1, 1, first, bf16_activations=True)
    parts = {p.path: p.bytes / 1e9 for p in footprint.estimate(config, shape)}
    assert 24 < parts["data.source"] < 25  # 24.6 GB of tables, as the profile reports
    assert sum(parts.values()) < 77.9
    recompute = footprint.estimate(config, dataclasses.replace(shape, plain_activations=False))
    assert recompute[-1].bytes < parts["data.global_batch_size"] * 1e9 / 10  # checkpointing keeps the inputs only
