"""Triton runs in its interpreter on CPU: set before anything imports triton."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import secrets
from collections.abc import Iterator

import pytest
import torch

SEED_ENV = "GEM_KERNELS_TEST_SEED"


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator with a fresh seed per test (or ``GEM_KERNELS_TEST_SEED``), printed and recorded so a
    failure can be replayed."""
    seed = int(os.environ.get(SEED_ENV) or secrets.randbits(31))
    print(f"{request.node.nodeid}: {SEED_ENV}={seed}")
    request.node.user_properties.append(("seed", seed))
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def poison() -> Iterator[None]:
    """Fresh ``torch.empty`` memory is NaN: a kernel output element nobody wrote shows as NaN."""
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    was_filling = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.utils.deterministic.fill_uninitialized_memory = was_filling
    torch.use_deterministic_algorithms(was_deterministic)

