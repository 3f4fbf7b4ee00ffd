"""The example callback through gem_model.testing: off unless named, on with its options, stateful."""

from __future__ import annotations

import json

import gem_plugin_example.plugin
from gem_model import testing
from gem_model.api import ReportSection
from gem_model.plugins import GemPluginManager
from gem_plugin_example.timer import StepTimer


def test_registered_as_a_callback():
    pm = GemPluginManager(autoload=False, plugins=[gem_plugin_example.plugin])
    assert pm.callbacks.get("step_timer").cls is StepTimer


def test_installed_but_not_named_it_does_nothing(tmp_path, capsys):
    testing.tiny_run(output_dir=tmp_path, steps=2, plugins=[gem_plugin_example.plugin])
    assert "step timer" not in capsys.readouterr().out


def test_named_it_times_the_steps_and_keeps_its_count_across_a_resume(tmp_path, capsys):
    on = "callbacks=[{name: step_timer, options: {skip_first: 1, write_json: true}}]"
    testing.tiny_run(on, output_dir=tmp_path, steps=3, plugins=[gem_plugin_example.plugin])
    out = capsys.readouterr().out
    assert "== step timer" in out and "2 this run, 2 in all" in out
    record = json.loads((tmp_path / "step_timer.json").read_text())
    assert record["step"] == 3 and record["layout"]["world_size"] == 1 and len(record["seconds"]) == 2
    testing.tiny_run(on, output_dir=tmp_path, steps=5, plugins=[gem_plugin_example.plugin])  # resumes at 3
    assert "1 this run, 3 in all" in capsys.readouterr().out


def test_hooks_called_directly_on_a_fake_run_context(tmp_path):
    run = testing.fake_run_context(output_dir=tmp_path, step=7)
    timer = StepTimer(StepTimer.Config(skip_first=0))
    (section,) = timer.gem_report_sections(run, summary=None)
    assert isinstance(section, ReportSection) and section.rows == [("steps timed", "0")]
    assert run.layout.dp_degree == 1 and run.step == 7
