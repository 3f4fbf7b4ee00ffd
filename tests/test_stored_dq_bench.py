"""benchmarks/stored_dq.py on the CPU: what it refuses without a GPU, and that it times the shipped launch.
Its timings need a GPU (benchmarks/results/e2e_ab.md has them)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: bench_modules beside this file
from bench_modules import load_benchmark


def test_without_a_gpu_it_says_so(monkeypatch):
    stored_dq = load_benchmark(monkeypatch, "stored_dq.py")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="times a GPU; none is visible"):
        stored_dq.main([])


def test_the_shipped_launch_is_among_the_candidates(monkeypatch):
    from gem_kernels import attention_stored

    candidates = load_benchmark(monkeypatch, "stored_dq.py").CANDIDATES
    assert attention_stored.LAUNCH in candidates and len(set(candidates)) == len(candidates)
