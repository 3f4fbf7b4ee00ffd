"""Where the Triton kernels can run, decided without importing them.

A Triton kernel runs on a CUDA device, or anywhere under ``TRITON_INTERPRET=1`` (Triton's own
interpreter: thousands of times slower, for tests). Everywhere else asking for it is an error that
says so; it never falls back to another kernel.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from gem_model.api import KernelUnavailableError

_TRUTHY = ("1", "true", "yes", "on", "y")


def interpreter_enabled() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET``)."""
    try:
        from triton import knobs
    except ImportError:
        return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUTHY
    return bool(knobs.runtime.interpret)


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why a Triton kernel cannot run on ``device``, or None when it can."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install triton)"
    if interpreter_enabled():
        return None
    if device.type != "cuda":
        return (
            f"Triton kernels need a CUDA device, got {device.type!r} (set TRITON_INTERPRET=1 to run "
            "them on CPU in Triton's interpreter, for tests only)"
        )
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None


def require_triton(device: torch.device, *, op: str, name: str, in_call: bool = False) -> None:
    """Raise :class:`KernelUnavailableError` when Triton cannot run on ``device``.

    From ``check_available`` the message is the reason alone (the run prefixes the config key);
    from a kernel call (``in_call``) it names the config key itself. While ``torch.compile`` traces
    a call it checks nothing: the run checked the device when it was built, and the traced code
    calls the kernels as custom ops (:mod:`gem_kernels.compiled_ops`).
    """
    if torch.compiler.is_compiling():
        return
    reason = triton_unavailable_reason(device)
    if reason is None:
        return
    message = f"{reason}; kernels.{op}: torch runs anywhere"
    if in_call:
        message = f"kernels.{op}: {name!r} cannot run here: {message}"
    raise KernelUnavailableError(message)
