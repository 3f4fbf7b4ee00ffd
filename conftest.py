"""Run from the repository root, pytest loads this file before any test module.

Triton decides at decoration time whether a ``@triton.jit`` function is compiled or interpreted, and
``triton.language`` itself is decorated on first import. So the interpreter must be chosen before
anything imports triton (torchrec, fbgemm-gpu and torch's inductor all may): on a machine without
CUDA, the kernels' tests run in Triton's interpreter."""

from __future__ import annotations

import os
import shutil

if "TRITON_INTERPRET" not in os.environ and shutil.which("nvidia-smi") is None:
    os.environ["TRITON_INTERPRET"] = "1"
