"""Triton runs in its interpreter on CPU: set before anything imports triton (so at import, not
in a fixture). Plugin autoload is switched off per test instead, so that it does not leak into
other packages' tests of a combined pytest session."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import secrets

import pytest
import torch

SEED_ENV = "GEM_PRECISION_TEST_SEED"


@pytest.fixture(autouse=True)
def _no_installed_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever is installed beside gem-precision, its tests see only what they register."""
    monkeypatch.setenv("GEM_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.delenv("GEM_PLUGINS", raising=False)


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator with a fresh seed per test (or ``GEM_PRECISION_TEST_SEED``), printed and recorded
    so that a failure can be replayed."""
    seed = int(os.environ.get(SEED_ENV) or secrets.randbits(31))
    print(f"{request.node.nodeid}: {SEED_ENV}={seed}")
    request.node.user_properties.append(("seed", seed))
    return torch.Generator().manual_seed(seed)
