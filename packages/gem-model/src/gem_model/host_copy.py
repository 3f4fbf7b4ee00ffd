"""Small host tensors made during a step (plans, per-key counts, flags) on the device without making
the host wait for it.

A copy from pageable host memory may synchronise with the stream before it starts (CUDA stages it
through page-locked memory), so the host waits for the device's queued work and the device then idles
while the host launches the next kernels: the profiles of the big config show device gaps ending in a
``Memcpy HtoD (Pageable -> Device)``. From page-locked memory with ``non_blocking`` the copy is only
queued; torch's caching host allocator keeps the page-locked block until the copy has run.
"""

from __future__ import annotations

import torch


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` (a small CPU tensor) on ``device``: on CUDA copied from page-locked memory without
    blocking the host; elsewhere a plain ``to``."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
