"""Core tests use plugins registered inline only: the core must not need any plugin package."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# pytest runs with --import-mode=importlib, which puts no test folder on sys.path; the MovieLens
# tests share their hand-made dataset through this folder's movielens_cases module
sys.path.insert(0, str(Path(__file__).resolve().parent))
from movielens_cases import source_factory

from gem_model import testing
from gem_model.config_io import load_config
from gem_model.plugins import GemPluginManager


@pytest.fixture(autouse=True)
def _no_installed_plugins(monkeypatch):
    """Whatever is installed beside the core, its tests see only what they register."""
    monkeypatch.setenv("GEM_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("GEM_PLUGINS", raising=False)

INLINE = list(testing.INLINE_COMPONENTS)


class TorchrunStarted(Exception):
    """What :func:`torchrun_start`'s ``os.execve`` raises in place of replacing the process with torchrun."""


@dataclass
class TorchrunStarts:
    started: type[Exception] = TorchrunStarted
    calls: list[tuple[list[str], dict[str, str]]] = field(default_factory=list)


@pytest.fixture
def torchrun_start(monkeypatch) -> TorchrunStarts:
    """``os.execve`` (how ``gem-train run`` starts torchrun) records its ``(argv, env)`` and raises
    ``.started``: a test sees what torchrun would have been given, and nothing is started."""
    starts = TorchrunStarts()

    def execve(path, argv, env):
        starts.calls.append((argv, env))
        raise starts.started

    monkeypatch.setattr(os, "execve", execve)
    return starts


@pytest.fixture
def pm() -> GemPluginManager:
    return GemPluginManager(autoload=False, plugins=[testing])


@pytest.fixture
def tiny_overrides(tmp_path: Path) -> list[str]:
    """A small, fast run on the inline plugins, writing under a temporary directory."""
    return [
        *INLINE,
        f"trainer.output_dir={tmp_path}/{{name}}",
        "trainer.steps=6",
        "trainer.log_every=1",
        "data.global_batch_size=16",
        "model.num_blocks=1",
        "data.source.options.max_len=15",
        "model.max_seq_len=16",
    ]


@pytest.fixture
def tiny_config(tiny_overrides):
    return load_config(None, tiny_overrides)


@pytest.fixture
def source(tmp_path):
    """``source(**options)``: a MovieLens source over the hand-made dataset of ``movielens_cases``."""
    return source_factory(tmp_path / "ml")
