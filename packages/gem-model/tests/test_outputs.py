"""One run, one metrics file: another run's metrics are refused, a resume trims the lines after its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gem_model.cli import main
from gem_model.config_io import load_config
from gem_model.errors import ConfigError
from gem_model.trainer import train


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def inline_env(monkeypatch):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")


def test_a_fresh_run_refuses_another_runs_metrics_naming_the_difference(pm, tiny_overrides, tmp_path):
    first = [*tiny_overrides, "trainer.steps=2", "trainer.checkpoint_at_end=false"]  # metrics, no checkpoint
    train(load_config(None, first), pm)
    before = (tmp_path / "gem-tiny" / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"trainer.output_dir: holds metrics.jsonl of another run") as info:
        train(load_config(None, [*first, "model.embedding_dim=16"]), pm)
    assert "model.embedding_dim (32 -> 16)" in str(info.value)
    assert (tmp_path / "gem-tiny" / "metrics.jsonl").read_text() == before  # nothing was overwritten


def test_metrics_no_run_file_vouches_for_are_refused_with_exit_2(capsys, inline_env, tiny_overrides, tmp_path):
    (tmp_path / "gem-tiny").mkdir()
    (tmp_path / "gem-tiny" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert main(["run", *tiny_overrides, "trainer.steps=2"]) == 2
    err = capsys.readouterr().err
    assert "trainer.output_dir" in err and "no readable run.json says which run wrote it" in err


def test_the_same_run_started_again_before_any_checkpoint_starts_its_metrics_over(pm, tiny_overrides, tmp_path):
    cfg = load_config(None, [*tiny_overrides, "trainer.steps=3", "trainer.checkpoint_at_end=false"])
    train(cfg, pm)
    first = [(r["step"], r["step_loss"]) for r in records(tmp_path / "gem-tiny")]
    train(cfg, pm)
    assert [(r["step"], r["step_loss"]) for r in records(tmp_path / "gem-tiny")] == first  # three lines, not six


def test_a_resume_drops_the_lines_after_its_checkpoint(pm, tiny_overrides, tmp_path):
    # a run that logged steps 1-4 and checkpointed at 2 only, as a kill after step 4 leaves it
    cfg = load_config(None, [*tiny_overrides, "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.checkpoint_at_end=false"])
    train(cfg, pm)
    out = tmp_path / "gem-tiny"
    uninterrupted = records(out)
    with (out / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 5, "lo')  # a line cut short by the kill
    train(cfg, pm)  # continues from step 2
    again = records(out)
    assert [r["step"] for r in again] == [1, 2, 3, 4]  # each step once
    assert [r["step_loss"] for r in again] == [r["step_loss"] for r in uninterrupted]


def test_resume_true_with_nothing_to_resume_exits_2_and_says_so(capsys, inline_env, tiny_overrides, tmp_path):
    assert main(["run", *tiny_overrides, "trainer.resume=true"]) == 2
    err = capsys.readouterr().err
    assert "trainer.resume: there is nothing to resume from" in err and "(got True)" in err
    assert not (tmp_path / "gem-tiny" / "metrics.jsonl").exists()  # refused before anything was built


def test_a_torn_metrics_line_is_reported_with_the_step_it_drops(pm, tiny_overrides, tmp_path, capsys):
    cfg = load_config(None, [*tiny_overrides, "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.checkpoint_at_end=false"])
    train(cfg, pm)
    metrics = tmp_path / "gem-tiny" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[0] = lines[0][:9]  # step 1's line damaged: before the checkpoint, so no resume logs it again
    metrics.write_text("\n".join(lines) + '\n{"step": 5, "lo')  # and a line a kill cut short
    capsys.readouterr()
    train(cfg, pm)  # continues from step 2
    said = capsys.readouterr().out
    assert f"{metrics} line 1 is torn (9 characters, not JSON; a kill cut it short): dropped its record of step 1; " \
           "it is lost: that step is not trained again" in said
    assert f"{metrics} line 5 is torn (15 characters, not JSON; a kill cut it short): dropped its record of step 5; " \
           "this run logs steps after 2 again" in said
    assert [r["step"] for r in records(tmp_path / "gem-tiny")] == [2, 3, 4]
