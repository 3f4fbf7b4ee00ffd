"""gem-train: exit codes, messages and output of each subcommand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gem_model.cli import main


@pytest.fixture
def inline_env(monkeypatch):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")


def test_malformed_config_exits_2_with_path_and_value(capsys):
    assert main(["run", "model.num_blocks=-2"]) == 2
    err = capsys.readouterr().err
    assert "model.num_blocks" in err and "(got -2)" in err


def test_malformed_config_fails_before_torchrun_is_launched(capsys, inline_env, tiny_overrides):
    assert main(["run", "--nproc", "2", *tiny_overrides, "trainer.steps=-1"]) == 2
    assert "trainer.steps" in capsys.readouterr().err


def test_more_processes_need_a_sharding_planner(capsys, inline_env, tiny_overrides):
    assert main(["run", "--nproc", "2", *tiny_overrides]) == 2
    assert "parallel.planner" in capsys.readouterr().err


def test_core_alone_names_the_packages_that_provide_the_defaults(capsys):
    assert main(["run"]) == 2
    err = capsys.readouterr().err
    for package in ("gem-kernels", "gem-precision", "gem-parallel", "gem-comm"):
        assert f"provided by {package}, which is not installed" in err


def test_run_trains_and_prints_the_summary(capsys, inline_env, tiny_overrides):
    assert main(["run", *tiny_overrides, "trainer.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "== summary" in out and "samples / s" in out


def test_nan_exits_3_with_the_step_counted_as_the_metrics_count(capsys, inline_env, tiny_overrides):
    code = main(["run", *tiny_overrides, "kernels.jagged_attention=poison", "kernels.jagged_attention.options.nan_from_call=2"])
    err = capsys.readouterr().err
    assert code == 3 and "NonFiniteLossError: step 2 (rank 0): the loss is nan" in err
    # the forward made the NaN: the parameters are all finite (read at the tables, trainer.loss_check: auto)
    assert "First non-finite parameter on this rank: none (every parameter is finite: this forward made it)" in err


def test_plugins_lists_distributions_and_names_per_registry(capsys, inline_env):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "gem-model" in out and "gem_model.testing" in out
    assert "precision.scheme:" in out and "inline_bf16" in out and "kernels.jagged_attention:" in out


def test_config_prints_resolved_config_and_schema(capsys, inline_env, tmp_path, tiny_overrides):
    (tmp_path / "run.toml").write_text('name = "demo"\n[model]\nnum_heads = 4\n')
    assert main(["config", "-c", str(tmp_path / "run.toml"), *tiny_overrides, "model.embedding_dim=64"]) == 0
    out = capsys.readouterr().out
    config_part, schema_part = out.split("# --- JSON schema ---")
    assert "name: demo" in config_part and "num_heads: 4" in config_part and "embedding_dim: 64" in config_part
    assert json.loads(schema_part)["title"] == "RunConfig"


def test_config_of_unknown_component_exits_2(capsys, inline_env):
    assert main(["config", "comm.strategy=pigeon"]) == 2
    assert "unknown comm strategy 'pigeon'" in capsys.readouterr().err


def test_profile_data_reports_padding_waste(capsys):
    assert main(["profile", "data", "--batches", "2"]) == 0
    assert "% useful" in capsys.readouterr().out


def test_python_dash_m_is_the_same_entry():
    env = {**os.environ, "GEM_DISABLE_PLUGIN_AUTOLOAD": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "gem_model", "run", "model.num_heads=0"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "model.num_heads" in proc.stderr


class _Left(Exception):
    """Raised by the test's ``leave_rank`` in place of ``os._exit``: carries the status."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


@pytest.fixture
def one_torchrun_rank(monkeypatch):
    """This process as rank 0 of a one-process torchrun launch (gloo on a free local port), with
    ``leave_rank`` raising :class:`_Left` instead of ending the process."""
    import socket

    import gem_model.distributed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"TORCHELASTIC_RUN_ID": "test", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    def leave(code: int) -> None:
        raise _Left(code)

    monkeypatch.setattr(gem_model.distributed, "leave_rank", leave)


def test_a_torchrun_rank_halted_by_a_nan_leaves_through_leave_rank_with_3(capsys, inline_env, tiny_overrides,
                                                                          one_torchrun_rank):  # fmt: skip
    """Not through the interpreter's exit, where a gloo group's threads torn down with it abort the
    rank now and then (torchrun then reports ``Signal 6``, not 3)."""
    import torch.distributed as dist

    with pytest.raises(_Left) as left:
        main(["run", *tiny_overrides, "kernels.jagged_attention=poison", "kernels.jagged_attention.options.nan_from_call=2"])
    assert left.value.code == 3
    assert "NonFiniteLossError: step 2 (rank 0): the loss is nan" in capsys.readouterr().err
    assert not dist.is_initialized()  # the run left its group before the rank left


def test_a_torchrun_rank_hit_by_a_bug_prints_the_traceback_and_leaves_with_1(capsys, monkeypatch, one_torchrun_rank):
    import gem_model.cli

    def bug(args):
        raise RuntimeError("a bug in the core")

    monkeypatch.setattr(gem_model.cli, "cmd_run", bug)
    with pytest.raises(_Left) as left:
        main(["run"])
    assert left.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: a bug in the core" in err, err


def test_outside_torchrun_a_bug_propagates(monkeypatch):
    import gem_model.cli

    def bug(args):
        raise RuntimeError("a bug in the core")

    monkeypatch.setattr(gem_model.cli, "cmd_run", bug)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(RuntimeError, match="a bug in the core"):
        main(["run"])
