"""The ``norm_gate`` kernels: ``(layer_norm(x) * weight + bias) * u``, the HSTU block's pointwise step.

``torch`` is the reference composition of torch ops; ``triton`` fuses forward and backward into one
pass each. Importing this module never imports triton.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gem_kernels.availability import require_triton
from gem_model.api import KernelUnavailableError, NormGateKernel


def check_norm_gate_inputs(x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> None:
    """Raise ValueError naming the argument whose shape does not fit ``x`` ``[..., D]``."""
    dim = x.shape[-1]
    if u.shape != x.shape:
        raise ValueError(f"norm_gate: u must have x's shape {tuple(x.shape)}, got {tuple(u.shape)}")
    if weight.shape != (dim,) or bias.shape != (dim,):
        raise ValueError(
            f"norm_gate: weight and bias must be [{dim}], got {tuple(weight.shape)} and {tuple(bias.shape)}"
        )


class TorchNormGate(NormGateKernel):
    """``F.layer_norm`` then the gate, as separate torch ops in at least float32 (16-bit inputs would
    otherwise round every intermediate, and the weight gradient sums those roundings)."""

    name = "torch"

    def __call__(
        self, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        check_norm_gate_inputs(x, u, weight, bias)
        compute = torch.promote_types(x.dtype, torch.float32)
        normed = F.layer_norm(x.to(compute), (x.shape[-1],), weight.to(compute), bias.to(compute), eps)
        return (normed * u.to(compute)).to(x.dtype)


class TritonNormGate(NormGateKernel):
    """One fused Triton pass forward and one backward (grads for x, u, weight and bias)."""

    name = "triton"

    def check_available(self, device: torch.device) -> None:
        require_triton(device, op=self.op, name=self.name)

    def __call__(
        self, x: torch.Tensor, u: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
    ) -> torch.Tensor:
        check_norm_gate_inputs(x, u, weight, bias)
        require_triton(x.device, op=self.op, name=self.name, in_call=True)
        from gem_kernels.norm_gate_triton import norm_gate_triton
        from gem_kernels.row_blocks import MAX_DIM

        if x.shape[-1] > MAX_DIM:
            raise KernelUnavailableError(
                f"kernels.{self.op}: 'triton' holds a row in registers and takes D <= {MAX_DIM}, got {x.shape[-1]}"
            )
        if torch.compiler.is_compiling():  # dynamo must not trace into the launchers: a custom op
            from gem_kernels.compiled_ops import norm_gate_op

            return norm_gate_op(x, u, weight, bias, eps)[0]
        return norm_gate_triton(x, u, weight, bias, eps)
