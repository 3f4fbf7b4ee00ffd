"""gem-kernels' hook implementations: registers every kernel it ships. Imports no triton."""

from __future__ import annotations

from gem_kernels.attention import TorchJaggedAttention, TritonJaggedAttention
from gem_kernels.next_item_loss import TritonNextItemLoss
from gem_kernels.norm_gate import TorchNormGate, TritonNormGate
from gem_kernels.sequence_input import TritonSequenceInput
from gem_kernels.sequence_pool import TritonSequencePool
from gem_model.api import Kernel, hookimpl


@hookimpl
def gem_register_kernels() -> list[type[Kernel]]:
    return [
        TorchJaggedAttention, TritonJaggedAttention, TorchNormGate, TritonNormGate, TritonNextItemLoss,
        TritonSequenceInput, TritonSequencePool,
    ]  # fmt: skip
