"""Imports of third-party packages whose failure needs a word on how to fix it.

torchrec loads fbgemm-gpu's native library when it is imported. A fbgemm-gpu build that does not
match this machine (the CUDA build on a CPU-only machine, or one built for another torch) fails
there with an OSError or ImportError about a shared library, which says nothing about the fix.
"""

from __future__ import annotations

from types import ModuleType

FIX = (
    "On a CPU machine install the CPU build: pip uninstall -y fbgemm-gpu && pip install fbgemm-gpu-cpu==1.8.0 "
    "&& pip install --no-deps torchrec==1.8.0 (see README 'Installing a selection'); on a GPU machine install "
    "the fbgemm-gpu build that matches your torch."
)


class TorchrecImportError(ImportError):
    """torchrec (or the fbgemm-gpu it loads) could not be imported; the message says how to fix it."""


def import_torchrec() -> ModuleType:
    """``import torchrec``, with a message that names the fix when fbgemm-gpu cannot be loaded."""
    try:
        import torchrec
    except ModuleNotFoundError as exc:
        if exc.name not in ("torchrec", "fbgemm_gpu"):
            raise
        raise TorchrecImportError(f"{exc.name} is not installed ({exc}). {FIX}") from exc
    except (OSError, ImportError) as exc:
        raise TorchrecImportError(f"torchrec could not load fbgemm-gpu: {exc}. {FIX}") from exc
    return torchrec
