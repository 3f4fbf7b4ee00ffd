"""``gem-train profile --sections`` and ``--section-budget``: only the sections asked for run, a
wrong name lists the registered ones, a section past its budget is cut off and reported, and the
report of the finished sections is written when a later one fails or the run is interrupted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gem_model import testing
from gem_model.cli import main
from gem_model.config_io import load_config
from gem_model.plugins import GemPluginManager
from gem_model.profiling.context import ProfileContext, copy_sharing_tables
from gem_model.profiling.render import load_report
from gem_model.profiling.runner import ProfileOptions, registered_sections, run_profile, unfinished
from gem_model.profiling.shared_model import initial_model

TINY = [*testing.INLINE_OVERRIDES]


@pytest.fixture(autouse=True)
def _plugins(monkeypatch):
    monkeypatch.setenv("GEM_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing,profile_plugin_cases,profile_cutoff_cases")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_only_the_selected_sections_run_and_no_steps_are_trained(tmp_path: Path):
    assert main(["profile", *TINY, "--out", str(tmp_path), "--batches", "2", "--sections", "sequences,third_party"]) == 0
    report = load_report(tmp_path)
    assert [s.name for s in report.sections] == ["sequences", "third_party"]
    assert report.section("third_party").summary["steps"] == 0  # neither step_time nor mfu: no steps measured
    assert (tmp_path / "profile.html").is_file()


def test_a_wrong_section_name_lists_the_registered_ones(capsys):
    assert main(["profile", *TINY, "--sections", "sequences,memroy"]) == 2
    err = capsys.readouterr().err
    assert "--sections" in err and "memroy" in err
    assert "memory (core)" in err and "third_party (plugin profile_plugin_cases of" in err and "recommendations (core)" in err


def test_registered_sections_in_report_order():
    names = list(registered_sections(GemPluginManager()))
    assert names == ["sequences", "balance", "step_time", "memory", "communication", "third_party", "endless",
                     "broken", "interrupted", "mfu", "recommendations"]  # fmt: skip


def test_a_section_past_its_budget_is_cut_off_and_a_failing_one_reported(tmp_path: Path, capsys):
    argv = ["profile", *TINY, "--out", str(tmp_path), "--batches", "2", "--sections", "sequences,endless",
            "--section-budget", "0.5"]  # fmt: skip
    assert main(argv) == 0  # cut off as asked: the report is complete otherwise
    report = load_report(tmp_path)
    assert unfinished(report) == {"endless": "timed_out"}
    assert 0.5 <= report.section("endless").summary["seconds"] < 30
    assert "budget of 0.5 s" in report.section("endless").notes[0]
    assert report.section("sequences").summary["batches"] == 2
    assert "section endless: timed out" in capsys.readouterr().out
    assert main(["profile", *TINY, "--out", str(tmp_path), "--batches", "2", "--sections", "broken,sequences"]) == 1
    report = load_report(tmp_path)
    assert [s.name for s in report.sections] == ["sequences", "broken"]  # the report's order, not the flag's
    assert unfinished(report) == {"broken": "failed"}
    assert "ValueError: a section that cannot be made" in report.section("broken").summary["error"]
    assert "profile_cutoff_cases" in report.section("broken").summary["error"]  # the plugin is named


def test_an_interrupted_profile_keeps_the_finished_sections(tmp_path: Path):
    config = load_config(None, TINY)
    options = ProfileOptions(out=tmp_path, batches=2, sections=("sequences", "balance", "interrupted"))
    with pytest.raises(KeyboardInterrupt):
        run_profile(config, GemPluginManager(), options)
    names = [s["name"] for s in json.loads((tmp_path / "profile.json").read_text())["sections"]]
    assert names == ["sequences", "balance"] and (tmp_path / "profile.html").is_file()


def test_a_bad_budget_exits_2(capsys):
    assert main(["profile", *TINY, "--section-budget", "0"]) == 2
    assert "--section-budget" in capsys.readouterr().err


def test_the_shared_model_is_built_once_and_copies_share_its_tables():
    pm, config, cpu = GemPluginManager(), load_config(None, TINY), torch.device("cpu")
    with pytest.raises(RuntimeError, match="no build_model"):
        ProfileContext(config, pm, cpu, 1, 1, 1, Path(".")).model()
    ctx = ProfileContext(config, pm, cpu, 1, 1, 1, Path("."), build_model=lambda: initial_model(config, pm, cpu))
    model = ctx.model()
    assert ctx.model() is model
    copy = copy_sharing_tables(model)
    for fqn, tables in model.table_modules().items():
        assert copy.get_submodule(fqn) is tables
    table_ids = {id(t) for m in model.table_modules().values() for t in m.parameters()}
    assert {id(p) for n, p in copy.named_parameters() if n.startswith("sparse.")} <= table_ids
    dense = dict(model.dense_named_parameters())
    assert all(p is not dense[n] and torch.equal(p, dense[n]) for n, p in copy.dense_named_parameters())
