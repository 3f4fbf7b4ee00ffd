"""Loading a script of ``benchmarks/`` as a module in a test (its helpers, which it imports by name,
live beside it)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(monkeypatch, script: str) -> ModuleType:
    """``benchmarks/<script>`` as a fresh module, with ``benchmarks/`` on ``sys.path`` for this test."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(Path(script).stem + "_bench", ROOT / "benchmarks" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module
