"""Every name gem-comm registers has a test module and a docs/comm.md entry (datasette's pattern)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gem_comm.plugin
from gem_model.plugins import GemPluginManager

HERE = Path(__file__).resolve().parent
DOC = (HERE.parents[2] / "docs" / "comm.md").read_text()
PM = GemPluginManager(autoload=False, plugins=[gem_comm.plugin])
STRATEGIES = PM.comm_strategies.names()
TESTED_IN = {  # name -> the test module that runs it
    "default": "test_default.py",
    "overlap": "test_dense_strategies.py",
    "quantized": "test_dense_strategies.py",
    "hierarchical": "test_dense_strategies.py",
    "sm_free": "test_sm_free.py",
    "comm_report": "test_comm_report.py",
    "sparse_dist": "test_sparse_dist.py",
}


def test_the_registered_names():
    assert STRATEGIES == sorted(["default", "overlap", "quantized", "hierarchical", "sm_free"])
    assert PM.callbacks.names() == ["comm_report"]
    assert PM.train_pipelines.names() == ["sequential", "sparse_dist"]  # sequential: the core's own


@pytest.mark.parametrize("name", [*STRATEGIES, "comm_report", "sparse_dist"])
def test_every_registered_name_has_a_test_and_a_docs_entry(name):
    assert name in TESTED_IN, f"{name!r} is registered but no test module is named for it here"
    text = (HERE / TESTED_IN[name]).read_text()
    registry = PM.comm_strategies if name in STRATEGIES else PM.train_pipelines if name == "sparse_dist" else PM.callbacks
    cls = registry.get(name).cls
    assert cls.__name__ in text or f'"{name}"' in text, f"{TESTED_IN[name]} does not exercise {name!r}"
    assert f"## `{name}`" in DOC, f"docs/comm.md has no section for {name!r}"


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_has_a_strict_config(name):
    cls = PM.comm_strategies.get(name).cls
    with pytest.raises(ValueError, match="extra"):
        cls.Config(no_such_option=1)
