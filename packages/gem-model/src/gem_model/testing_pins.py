"""Losses pinned bit for bit, one recorded set per CPU family (re-exported by :mod:`gem_model.testing`).

CPU kernels (MKL, oneDNN, ATen's vectorised loops) round sums differently per instruction set, so
a run's losses repeat bit for bit on one kind of machine and differ in their last bits on another.
Forcing one instruction set does not make them agree everywhere, so a pin keeps one set of losses
per CPU family, each labelled by where and at which commit it was recorded, and a run must equal
one of them exactly, every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch


def assert_pinned(
    actual: Sequence[str], pins: Mapping[str, Sequence[str]], what: str, *, steps: Sequence[int] | None = None
) -> str:
    """Pass when ``actual`` (``float.hex`` of each loss) equals one set of ``pins`` exactly, and return
    that set's label; ``pins`` maps a label (the CPU family and commit it was recorded on) to its losses.
    ``what`` names the pins for the message (file and name, how they were measured); ``steps`` gives the
    step of each loss where it is not 1, 2, 3, ... (a skipped update leaves no loss)."""
    if not pins:
        raise ValueError(f"{what}: no pinned sets to compare with")
    actual = list(actual)
    for label, pinned in pins.items():
        if actual == list(pinned):
            return label
    numbers = list(steps) if steps is not None else list(range(1, max(map(len, [actual, *pins.values()])) + 1))
    lines = [f"{what}: the losses equal none of the {len(pins)} pinned sets.", f"  this run: {actual!r}"]
    for label, pinned in pins.items():
        i = next(i for i, (a, p) in enumerate(zip([*actual, None], [*pinned, None])) if a != p)
        step = f"step {numbers[i]}" if i < len(numbers) else f"loss {i + 1}"
        here = actual[i] if i < len(actual) else "nothing"
        there = pinned[i] if i < len(pinned) else "nothing"
        lines.append(f"  {label!r}: first differs at {step}: {here} here, {there} pinned")
    lines.append(
        "Losses differ in their last bits between CPU families. If this machine's family (torch CPU "
        f"capability {torch.backends.cpu.get_cpu_capability()}, see lscpu) has no set yet, check that this "
        "commit reproduces a known set on that set's machine, then add this run's losses to "
        f"{what} as a new set labelled '<CPU family>, <commit>' (git rev-parse --short HEAD). "
        "Otherwise the arithmetic changed."
    )
    raise AssertionError("\n".join(lines))
