"""What the device can do, asked of the device (never assumed from the package being installed)."""

from __future__ import annotations

import os

import torch

FP8_MIN_CAPABILITY = (8, 9)
"""fp8 tensor cores and ``torch._scaled_mm`` with fp8 operands: Ada (8.9), Hopper (9.0) and later."""
MX_NATIVE_MIN_CAPABILITY = (10, 0)
"""cuBLAS block-scaled MXFP8 GEMM (``torch._scaled_mm`` with e8m0 scales): Blackwell and later."""


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_capability(device)


def has_capability(device: torch.device, minimum: tuple[int, int]) -> bool:
    cap = cuda_capability(device)
    return cap is not None and cap >= minimum


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def can_run_triton(device: torch.device) -> bool:
    """Triton kernels with fp8 ``tl.dot`` run on CUDA >= 8.9, or on CPU under TRITON_INTERPRET=1."""
    return has_capability(device, FP8_MIN_CAPABILITY) or (device.type == "cpu" and triton_interpreting())


def describe(device: torch.device) -> str:
    cap = cuda_capability(device)
    return f"{device}" if cap is None else f"{device} (compute capability {cap[0]}.{cap[1]})"
