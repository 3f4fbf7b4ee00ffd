"""The attention mask of the references is built one bool per pair, never as an int64 difference."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gem_kernels.reference import attention_mask


class LargestTensor(TorchDispatchMode):
    """The bytes of the largest tensor any op inside the mode returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_no_tensor_of_the_mask_is_wider_than_one_byte_per_pair():
    # two sequences of 600 with targets and a window: the old mask held an int64 [B, n, n] difference
    lengths, targets, n = torch.tensor([600, 450]), torch.tensor([1, 2]), 600
    for window in (0, 16):
        with LargestTensor() as meter:
            mask = attention_mask(lengths, targets, window, n)
        assert mask.dtype == torch.bool and mask.shape == (2, n, n)
        assert meter.largest <= 2 * n * n, f"a {meter.largest}-byte tensor for {2 * n * n} pairs (window {window})"
