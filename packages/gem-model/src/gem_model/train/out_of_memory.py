"""What a run says when a step runs the device out of memory.

torch's own error names the allocation and the device's memory, but not the step, what the run kept,
or which of the run's settings lower its peak. :func:`out_of_memory_error` adds them; the run's metrics
up to the failed step are written as for any other failure.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gem_model.config import RunConfig
from gem_model.errors import DeviceOutOfMemoryError
from gem_model.plugins import GemPluginManager

_TORCH_ADVICE = (" If reserved but unallocated", " See documentation")


def torch_account(exc: torch.OutOfMemoryError) -> str:
    """torch's message up to its advice: the allocation asked for and the device's memory."""
    text = " ".join(str(exc).split())
    cut = min((i for i in (text.find(a) for a in _TORCH_ADVICE) if i >= 0), default=len(text))
    return text[:cut].rstrip()


def out_of_memory_error(config: RunConfig, pm: GemPluginManager, step: int, exc: torch.OutOfMemoryError,
                        last_checkpoint: Path | None) -> DeviceOutOfMemoryError:  # fmt: skip
    """The error for step ``step`` (0-based) stopped by ``exc``."""
    tc = config.trainer
    kept = (
        f"the last checkpoint is {last_checkpoint}, and the same command continues from it"
        if last_checkpoint is not None
        else "no checkpoint was written before it (trainer.checkpoint_every=N writes one every N steps)"
    )
    policies = ", ".join(name for name in pm.activation_policies.names() if name != config.activation.policy.name)
    lower = [
        f"data.global_batch_size (now {config.data.global_batch_size})",
        f"model.max_seq_len (now {config.model.max_seq_len})",
        f"activation.policy (now {config.activation.policy.name!r}"
        + (f"; installed: {policies})" if policies else ")"),
    ]
    if "expandable_segments" not in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get(
        "PYTORCH_ALLOC_CONF", ""
    ):
        lower.append("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True where much is reserved but unallocated")
    return DeviceOutOfMemoryError(
        f"[{config.name}] the device ran out of memory in step {step + 1} of {tc.steps}: {torch_account(exc)} "
        f"Metrics up to it are written; {kept}. What lowers the peak: {'; '.join(lower)}."
    )
