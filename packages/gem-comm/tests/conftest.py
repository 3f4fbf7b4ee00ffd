"""gem-comm's tests share their multi-process helpers through this folder (comm_*.py modules)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# pytest runs with --import-mode=importlib, which puts no test folder on sys.path
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session")
def spawned(tmp_path_factory):
    """``spawned(world)``: what every process of one start of ``world`` gloo processes returned from
    :func:`comm_cases.run_all` (cached: starting the processes is most of a test's time)."""
    from comm_cases import run_all
    from comm_spawn import spawn

    cache: dict[int, dict] = {}

    def get(world: int) -> dict:
        if world not in cache:
            cache[world] = spawn(run_all, world, tmp_path_factory.mktemp(f"ranks{world}"))
        return cache[world]

    return get
