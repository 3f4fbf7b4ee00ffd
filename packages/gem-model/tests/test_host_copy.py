"""gem_model.host_copy.to_device_async: a step's small host tensors reach a CUDA device from page-locked
memory without blocking the host, and other devices by a plain copy."""

from __future__ import annotations

import torch

from gem_model.host_copy import to_device_async


def test_on_the_cpu_it_is_a_plain_copy_with_the_same_values():
    host = torch.tensor([[3, 1, 4], [1, 5, 9]])
    out = to_device_async(host, torch.device("cpu"))
    assert torch.equal(out, host) and out.dtype == host.dtype


class _Host:
    """Stands for a CPU tensor: records what is asked of it (a CUDA device is not at hand in CI)."""

    def __init__(self, calls: list, pinned: bool = False):
        self.calls, self.pinned = calls, pinned

    def pin_memory(self):
        self.calls.append("pin_memory")
        return _Host(self.calls, pinned=True)

    def to(self, device, non_blocking=False):
        self.calls.append(("to", str(device), non_blocking, self.pinned))
        return "on device"


def test_for_cuda_it_pins_then_copies_without_blocking():
    calls: list = []
    assert to_device_async(_Host(calls), torch.device("cuda", 0)) == "on device"
    assert calls == ["pin_memory", ("to", "cuda:0", True, True)]

