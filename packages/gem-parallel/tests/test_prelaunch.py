"""Every degree constraint stops ``gem-train run --nproc N`` with exit 2 before torchrun starts a worker.

``gem-train run`` checks the run (:func:`gem_model.checks.check_run`) and only then replaces itself
with torchrun (``os.execve``); here ``os.execve`` fails the test, so a problem found after the launch,
or none found at all, cannot pass.
"""

from __future__ import annotations

import os

import pytest

from gem_model import testing
from gem_model.cli import main


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    launched: list[list[str]] = []

    def execve(path, argv, env):
        launched.append(argv)
        raise AssertionError(f"torchrun was started: {argv}")

    monkeypatch.setattr(os, "execve", execve)
    yield [*testing.INLINE_OVERRIDES, "trainer.progress=false", f"trainer.output_dir={tmp_path}/{{name}}"]
    assert launched == []


def run(capsys, *args: str) -> tuple[int, str]:
    code = main(["run", *args])
    return code, capsys.readouterr().err


def test_tp_that_does_not_divide_the_heads_exits_2_naming_the_fields(no_launch, capsys, tmp_path):
    code, err = run(capsys, "--nproc", "4", *no_launch, "model.num_heads=2", "parallel.planner=fsdp",
                    "parallel.planner.options.tp=4")  # fmt: skip
    assert code == 2, err
    assert "parallel.planner.options.tp: must divide model.num_heads = 2" in err and "(got 4)" in err
    assert not (tmp_path / "gem-tiny").exists()  # nothing was written


def test_every_degree_problem_comes_in_one_round(no_launch, capsys):
    code, err = run(capsys, "--nproc", "8", *no_launch, "model.num_heads=2", "data.global_batch_size=7",
                    "parallel.planner=fsdp", "parallel.planner.options.tp=4")  # fmt: skip
    assert code == 2, err
    assert "parallel.planner.options.tp: must divide model.num_heads = 2" in err
    assert "data.global_batch_size: must divide evenly over the 2 data-parallel ranks" in err
    code, err = run(capsys, "--nproc", "4", *no_launch, "data.global_batch_size=6", "parallel.planner=fsdp")
    assert code == 2 and "data.global_batch_size: must divide evenly over the 4 data-parallel ranks" in err, err
    code, err = run(capsys, "--nproc", "4", *no_launch, "model.max_seq_len=16", "parallel.planner=fsdp",
                    "parallel.planner.options.cp=4", "parallel.planner.options.tables=sharded",
                    "parallel.planner.options.sparse=3")  # fmt: skip
    assert code == 2 and "parallel.planner.options.sparse: must divide the world size 4" in err, err


def test_tensor_parallelism_needs_the_block_linears_unconverted(no_launch, capsys):
    code, err = run(capsys, "--nproc", "2", *no_launch, "precision.scheme=inline_bf16", "parallel.planner=fsdp",
                    "parallel.planner.options.tp=2")  # fmt: skip
    assert code == 2, err
    assert "parallel.planner.options.tp: tensor parallelism splits the HSTU blocks' uvqk and out" in err
    assert "blocks.0.uvqk (inline_bf16: _Bf16Linear)" in err and "precision.exclude" in err


def test_bfloat16_lookups_on_the_cpu_exit_2_naming_the_option(no_launch, capsys):
    """FBGEMM's CPU sequence lookup has no bfloat16 output: said before any process starts, for both
    planners that shard tables with torchrec."""
    for planner in (["parallel.planner=torchrec_ddp"], ["parallel.planner=fsdp", "parallel.planner.options.tables=sharded"]):
        code, err = run(capsys, "--nproc", "2", *no_launch, "trainer.device=cpu", *planner,
                        "parallel.planner.options.table_output_dtype=bfloat16")  # fmt: skip
        assert code == 2, err
        assert "parallel.planner.options.table_output_dtype: FBGEMM's CPU sequence lookup has no bfloat16 output" in err


def test_lookup_dtype_with_replicated_tables_exits_2(no_launch, capsys):
    code, err = run(capsys, "--nproc", "2", *no_launch, "parallel.planner=fsdp",
                    "parallel.planner.options.table_output_dtype=float16")  # fmt: skip
    assert code == 2, err
    assert "parallel.planner.options.table_output_dtype: is the output dtype of torchrec's sharded lookups: it needs tables: sharded" in err
