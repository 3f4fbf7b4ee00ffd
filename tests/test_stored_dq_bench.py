"""benchmarks/stored_dq.py on the CPU: what it refuses without a GPU, and that it times the shipped launch.
Its timings need a GPU (benchmarks/results/e2e_ab.md has them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def stored_dq(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import stored_dq

    return stored_dq


def test_without_a_gpu_it_says_so(stored_dq, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="times a GPU; none is visible"):
        stored_dq.main([])


def test_the_shipped_launch_is_among_the_candidates(stored_dq):
    from gem_kernels import attention_stored

    assert attention_stored.LAUNCH in stored_dq.CANDIDATES
    assert len(set(stored_dq.CANDIDATES)) == len(stored_dq.CANDIDATES)
