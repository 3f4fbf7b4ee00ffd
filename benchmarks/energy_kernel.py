"""What ``kernel_energy.py`` measures: a kernel's call and the work it counts, and the check every kernel
passes before it is measured (the GEMM rows in ``kernel_energy.py``, the attention rows in
``kernel_energy_attention.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class Kernel:
    call: Callable[[], object]
    flops: float = 0.0
    """FLOPs of the MMAs a call runs."""
    bytes: float = 0.0
    """Bytes a call must move through HBM at least."""


def refuse_if_wrong(name: str, got: torch.Tensor, want: torch.Tensor, tolerance: float,
                    against: str = "the float32 product") -> None:  # fmt: skip
    """End the run before ``name`` is measured if its result is not within ``tolerance`` (relative, by
    norm) of ``want``, which is ``against``."""
    want = want.float()
    error = ((got.float() - want).norm() / want.norm().clamp(min=1e-30)).item()
    if not error <= tolerance:
        raise SystemExit(f"{name}: relative error {error:.2e} against {against} (limit {tolerance}), "
                         "refusing to measure it")  # fmt: skip
