"""Activation memory policies: what an HSTU block keeps for backward.

- ``none``: everything autograd saves (the block is returned unchanged);
- ``checkpoint_full``: nothing inside the block; the whole block is recomputed in backward
  (``torch.utils.checkpoint``, non-reentrant);
- ``checkpoint_selective``: the outputs of the GEMM ops (``mm``, ``addmm``, ``bmm``, ``_scaled_mm`` by
  default) are kept, the cheap pointwise ops around them are recomputed
  (``create_selective_checkpoint_contexts``). Ops that are not aten ops (e.g. Triton kernels) are
  recomputed;
- ``fp8_saved``: activations the block saves are stored in fp8 e4m3 and expanded in backward. The
  block's output is that of ``none`` (bit for bit on the fused path on the H200, 2026-12-04); its
  gradients differ by fp8 rounding of the saved activations (relative error ~2**-4 per element at
  worst). Two ways, chosen at every forward:

  - in the block's own kernels (``in_kernels``, the default): a block that is a
    :class:`~gem_model.api.SavedFormatBlock` (the HSTU block) gets ``saved_format = "e4m3_row"``, and a
    forward that takes a path whose kernels store that format (the HSTU block fused by gem-kernels'
    ``triton``: its gap keeps the uvqk output in e4m3 rows written by its silu pass and recomputes
    silu of it in backward, and the attention output in e4m3 rows written by the norm-gate's pass)
    runs with no hooks: no Python per saved tensor, no pass of its own in forward. What the block's
    other modules save (the linears' inputs, the layer norm's input) stays as computed;
  - through ``saved_tensors_hooks`` (every other forward: op by op, compiled, other kernels, or
    ``in_kernels: false``): every activation autograd saves in the block, with per-32-block or per-row
    scales (:mod:`gem_precision.saved_tensors`). Parameters, integer and small tensors are kept as they
    are. It halves what is kept between forward and backward; its step-time cost is the HBM traffic of
    compressing (~3 bytes moved per saved byte: ~600/d times the block's GEMM time at width d) plus the
    hooks' Python per tensor, and the peak falls much less than the saved bytes, as the backward
    nodes' transients stay (see :mod:`gem_precision.saved_tensors` for both).

Wrapping keeps the block object: its ``forward`` is replaced on the instance, so parameter names,
state-dict keys, hooks and ``isinstance`` checks are those of the original block. A block can carry
one policy; wrapping it twice is an error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, field_validator
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from gem_model.api import E4M3_ROW, ActivationPolicy, ComponentConfig, SavedFormatBlock
from gem_precision.saved_tensors import Fp8SavedTensors, SavedTensorStats

POLICY_ATTR = "_gem_activation_policy"


class PolicyForward:
    """Stands in for a block's ``forward``: runs the original under an activation policy."""

    def __init__(self, forward: Callable[..., Any], run: Callable[..., Any]):
        self.forward = forward
        self.run = run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved without autograd: no policy to apply
            return self.forward(*args, **kwargs)
        return self.run(self.forward, *args, **kwargs)


def install(block: nn.Module, fqn: str, policy: str, run: Callable[..., Any]) -> nn.Module:
    current = getattr(block, POLICY_ATTR, None)
    if current is not None:
        raise ValueError(f"{fqn}: block already has activation policy {current!r}; cannot add {policy!r}")
    block.forward = PolicyForward(block.forward, run)  # type: ignore[method-assign]
    setattr(block, POLICY_ATTR, policy)
    return block


class NoActivationPolicy(ActivationPolicy):
    """Keeps everything autograd saves."""

    name: ClassVar[str] = "none"

    class Config(ComponentConfig):
        pass

    def wrap_block(self, block: nn.Module, fqn: str) -> nn.Module:
        return block


class CheckpointFullPolicy(ActivationPolicy):
    """Recomputes the whole block in backward; keeps only its inputs."""

    name: ClassVar[str] = "checkpoint_full"

    class Config(ComponentConfig):
        preserve_rng_state: bool = Field(True, description="replay dropout masks exactly in the recompute")

    def wrap_block(self, block: nn.Module, fqn: str) -> nn.Module:
        return install(block, fqn, self.name, self._run)

    def _run(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            forward, *args, use_reentrant=False, preserve_rng_state=self.config.preserve_rng_state, **kwargs
        )


DEFAULT_SAVE_OPS = ("mm", "addmm", "bmm", "_scaled_mm")


def resolve_aten_op(name: str) -> torch._ops.OpOverload:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None or not hasattr(packet, "default"):
        raise ValueError(f"activation.policy checkpoint_selective: save_ops: unknown aten op {name!r}")
    return packet.default


class CheckpointSelectivePolicy(ActivationPolicy):
    """Keeps the GEMM outputs, recomputes the pointwise ops between them."""

    name: ClassVar[str] = "checkpoint_selective"

    class Config(ComponentConfig):
        save_ops: tuple[str, ...] = Field(DEFAULT_SAVE_OPS, description="aten ops whose outputs are kept")
        preserve_rng_state: bool = True

        @field_validator("save_ops")
        @classmethod
        def _known_ops(cls, ops: tuple[str, ...]) -> tuple[str, ...]:
            for op in ops:
                resolve_aten_op(op)
            return ops

    def __init__(self, config: ComponentConfig | None = None):
        super().__init__(config)
        self._save = frozenset(resolve_aten_op(op) for op in self.config.save_ops)

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in self._save else CheckpointPolicy.PREFER_RECOMPUTE

    def wrap_block(self, block: nn.Module, fqn: str) -> nn.Module:
        return install(block, fqn, self.name, self._run)

    def _run(self, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint(
            forward,
            *args,
            use_reentrant=False,
            preserve_rng_state=self.config.preserve_rng_state,
            context_fn=functools.partial(create_selective_checkpoint_contexts, self.policy),
            **kwargs,
        )


class Fp8SavedPolicy(ActivationPolicy):
    """Stores the block's saved activations in fp8 e4m3: in the block's own kernels where its forward
    can (:mod:`gem_model.saved_format`), else through saved-tensor hooks (:mod:`gem_precision.saved_tensors`).

    ``stats`` accumulates, since :meth:`reset_stats`, what the hooks saved, and counts the forwards
    whose kernels compressed instead (``kernel_forwards``: no hook sees their tensors, so their bytes
    are what autograd keeps, as an outer :class:`~gem_precision.saved_tensors.CountSavedTensors` or
    the profile's memory section counts them).
    """

    name: ClassVar[str] = "fp8_saved"

    class Config(ComponentConfig):
        granularity: Literal["block32", "row"] = Field(
            "block32",
            description="scales of what the hooks compress: block32: MXFP8 (one e8m0 scale per 32 along the last "
            "dim); row: one scale per row (the block's own kernels always use row scales, e4m3_row)",
        )
        min_numel: int = Field(65536, ge=1, description="tensors with fewer elements are kept as they are (hooks)")
        in_kernels: bool = Field(
            True,
            description="a block whose kernels can store what they save in e4m3 rows (gem_model.saved_format: the "
            "HSTU block on gem-kernels' fused path) does so, without hooks, in each forward that takes that path; "
            "false: hooks on every forward",
        )

    def __init__(self, config: ComponentConfig | None = None):
        super().__init__(config)
        self.stats = SavedTensorStats()

    def reset_stats(self) -> None:
        self.stats = SavedTensorStats()

    def wrap_block(self, block: nn.Module, fqn: str) -> nn.Module:
        in_kernels = self.config.in_kernels and isinstance(block, SavedFormatBlock)
        install(block, fqn, self.name, functools.partial(self._run, block, in_kernels))
        if in_kernels:
            block.saved_format = E4M3_ROW  # type: ignore[union-attr]
        return block

    def _run(self, block: nn.Module, in_kernels: bool, forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if in_kernels and block.saves_in_kernels():  # type: ignore[operator]
            self.stats.kernel_forwards += 1
            return forward(*args, **kwargs)
        codec = Fp8SavedTensors(
            granularity=self.config.granularity, min_numel=self.config.min_numel, parameters=block.parameters()
        )
        with torch.autograd.graph.saved_tensors_hooks(codec.pack, codec.unpack):
            out = forward(*args, **kwargs)
        self.stats.add(codec.stats)
        return out


POLICIES: list[type[ActivationPolicy]] = [
    NoActivationPolicy,
    CheckpointFullPolicy,
    CheckpointSelectivePolicy,
    Fp8SavedPolicy,
]
