"""gem-comm's ``comm_measured`` profile section: the strategy's measured bytes, calls and exposed
seconds per step, and the overlap recommendation when exposed time is worth hiding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gem_comm import plugin
from gem_model import testing
from gem_model.config_io import load_config
from gem_model.plugins import GemPluginManager
from gem_model.profiling.context import MeasuredSteps, ProfileContext
from gem_model.profiling.report import ProfileSection


def context(measured: MeasuredSteps | None) -> ProfileContext:
    pm = GemPluginManager(autoload=False, plugins=[testing, plugin])
    ctx = ProfileContext(load_config(None, list(testing.INLINE_OVERRIDES)), pm, torch.device("cpu"), 2, 2, 1,
                         Path("."), measured)  # fmt: skip
    ctx.sections["communication"] = ProfileSection("communication", "c", summary={"bytes_per_dim": {"dense": 3e6}})
    return ctx


def sections(ctx: ProfileContext) -> list[ProfileSection]:
    return [s for group in ctx.plugins.call("gem_profile_sections", profile=ctx) for s in group]


def test_exposed_time_and_bytes_per_step():
    measured = MeasuredSteps(
        step_seconds=[0.04, 0.06], tokens=[10, 10], flops=[1.0, 1.0], comm_strategy="quantized", world_size=2,
        comm_per_step={"dense.all_reduce.bytes": 2e6, "dense.all_reduce.calls": 4.0, "dense.all_reduce.seconds": 0.01,
                       "embedding.all_to_all.bytes": 5e5, "embedding.all_to_all.calls": 2.0},
    )  # fmt: skip
    (section,) = sections(context(measured))
    assert section.name == "comm_measured"
    assert section.summary["exposed_seconds"] == 0.01 and section.summary["exposed_share"] == pytest.approx(0.2)
    assert section.summary["measured_bytes"] == 2.5e6
    rows = {r[0]: r for r in section.tables[0].rows}
    assert rows["dense.all_reduce"][1:] == [2.0, 4.0, "10.000 ms exposed"]
    assert rows["embedding.all_to_all"][3] == "asynchronous (not timed)"
    (rec,) = section.recommendations
    assert rec.action == "comm.strategy=overlap" and rec.expected_gain == pytest.approx(0.2)
    assert "plan implies 3.000 MB" in section.notes[0]


def test_no_measured_steps_no_section_and_a_silent_strategy_says_so():
    assert sections(context(None)) == []
    quiet = MeasuredSteps([0.1], [1], [1.0], comm_strategy="default")
    (section,) = sections(context(quiet))
    assert section.tables[0].rows == [] and "records no measurements" in section.notes[0]
    assert section.recommendations == []
