"""Switches of ``benchmarks/e2e_ab.py`` that set module attributes (read where the code calls them) and
put the old values back on undo: shared by :mod:`ab_switches` and :mod:`ab_switches_precision`."""

from __future__ import annotations

import importlib
from collections.abc import Callable

Switch = Callable[[object], Callable[[], None]]
"""Applied to a live run; returns the function that undoes it."""


def patched(module: str, name: str, value: object) -> Switch:
    """``module.name`` set to ``value``, the old value put back on undo."""

    def apply(run: object) -> Callable[[], None]:
        mod = importlib.import_module(module)
        before = getattr(mod, name)
        setattr(mod, name, value)
        return lambda: setattr(mod, name, before)

    return apply


def all_of(*switches: Switch) -> Switch:
    """The switches applied in order, undone in the reverse order."""

    def apply(run: object) -> Callable[[], None]:
        undos = [switch(run) for switch in switches]

        def undo() -> None:
            for each in reversed(undos):
                each()

        return undo

    return apply
