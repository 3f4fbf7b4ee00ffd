"""Meta-tests that keep the extension surface honest: every hook is typed, documented and tested."""

from __future__ import annotations

import inspect
from pathlib import Path

from gem_model import hookspecs

HOOKS = [name for name, fn in vars(hookspecs).items() if name.startswith("gem_") and inspect.isfunction(fn)]
TESTS = Path(__file__).resolve().parent


def test_there_are_registration_and_lifecycle_hooks():
    assert {"gem_register_kernels", "gem_register_precision_schemes", "gem_register_comm_strategies",
            "gem_register_parallel_planners", "gem_train_step", "gem_run_started"} <= set(HOOKS)


def test_every_hook_is_documented_and_typed():
    for name in HOOKS:
        fn = getattr(hookspecs, name)
        assert fn.__doc__ and len(fn.__doc__.strip()) > 40, f"{name} needs a docstring"
        assert "return" in fn.__annotations__, f"{name} needs a return annotation"


def test_every_hook_is_used_in_a_test():
    tests = [p for p in TESTS.glob("*.py") if p.name != Path(__file__).name]
    text = "\n".join(p.read_text() for p in tests)
    untested = [name for name in HOOKS if name not in text]
    assert untested == []
