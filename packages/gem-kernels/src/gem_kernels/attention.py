"""The ``jagged_attention`` kernels: ``torch`` (bucketed, the CPU default) and ``triton``.

Importing this module never imports triton; the Triton kernel loads its module on first call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import model_validator

from gem_kernels.attention_torch import LayoutCache, jagged_attention_torch
from gem_kernels.availability import require_triton
from gem_model.api import (
    E4M3_ROW,
    NO_EXTRAS,
    AttentionExtras,
    ComponentConfig,
    JaggedAttentionKernel,
    KernelUnavailableError,
    NormGateKernel,
)

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_offsets: torch.Tensor, extras: AttentionExtras,
    max_seq_len: int,
) -> None:
    """Raise ValueError naming the argument whose shape, dtype or value is wrong."""
    num_targets, max_attn_len = extras.num_targets, extras.max_attn_len
    problem = None
    if q.dim() != 3 or k.shape != q.shape:
        problem = f"q and k must both be [L, H, Dqk], got {tuple(q.shape)} and {tuple(k.shape)}"
    elif v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        problem = f"v must be [L, H, Dv] with the L and H of q {tuple(q.shape)}, got {tuple(v.shape)}"
    elif not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        problem = f"q, k, v need one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    elif seq_offsets.dim() != 1 or seq_offsets.numel() < 2 or seq_offsets.is_floating_point():
        problem = f"seq_offsets must be integer [B + 1], B >= 1, got {seq_offsets.dtype} {tuple(seq_offsets.shape)}"
    elif num_targets is not None and (
        num_targets.shape != (seq_offsets.numel() - 1,) or num_targets.is_floating_point()
    ):
        problem = f"num_targets must be integer [B], got {num_targets.dtype} {tuple(num_targets.shape)}"
    elif max_seq_len <= 0 or max_attn_len < 0:
        problem = f"need max_seq_len > 0 and max_attn_len >= 0, got {max_seq_len} and {max_attn_len}"
    if problem is not None:
        raise ValueError(f"jagged_attention: {problem}")


def check_time_inputs(q: torch.Tensor, extras: AttentionExtras) -> None:
    """The time bias comes with both timestamp vectors, integer ``[L]``, or none of the three comes."""
    time_bias, timestamps, query_timestamps = extras.time_bias, extras.timestamps, extras.query_timestamps
    given = [t is not None for t in (time_bias, timestamps, query_timestamps)]
    if not any(given):
        return
    problem = None
    if not all(given):
        problem = "time_bias, timestamps and query_timestamps come together (all three or none)"
    else:
        assert time_bias is not None and timestamps is not None and query_timestamps is not None
        for name, t in (("timestamps", timestamps), ("query_timestamps", query_timestamps)):
            if t.shape != (q.shape[0],) or t.is_floating_point():
                problem = f"{name} must be integer [L] = [{q.shape[0]}], got {t.dtype} {tuple(t.shape)}"
                break
        else:
            if time_bias.dim() != 1 or time_bias.numel() == 0:
                problem = f"time_bias must be a non-empty [num_buckets] vector, got {tuple(time_bias.shape)}"
    if problem is not None:
        raise ValueError(f"jagged_attention: {problem}")


class TorchJaggedAttention(JaggedAttentionKernel):
    """Pure torch; sequences bucketed by length, each bucket padded to its own longest sequence."""

    name = "torch"
    supports_position_bias = True
    supports_time_bias = True

    def __init__(self, config: ComponentConfig | None = None):
        super().__init__(config)
        self.cache = LayoutCache()  # the blocks of a model share the layout of a step's sequences

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        *,
        max_seq_len: int,
        alpha: float,
        extras: AttentionExtras = NO_EXTRAS,
    ) -> torch.Tensor:
        check_attention_inputs(q, k, v, seq_offsets, extras, max_seq_len)
        check_time_inputs(q, extras)
        return jagged_attention_torch(q, k, v, seq_offsets, max_seq_len=max_seq_len, alpha=alpha, extras=extras,
                                      cache=self.cache)  # fmt: skip


class TritonJaggedAttention(JaggedAttentionKernel):
    """Triton forward and backward (CUDA, or CPU under ``TRITON_INTERPRET=1``), with both relative biases."""

    name = "triton"
    supports_position_bias = True
    supports_time_bias = True
    saved_formats = (E4M3_ROW,)  # the fused gap keeps its pre-activation in e4m3 rows (hstu_gap_saved)

    class Config(ComponentConfig):
        dq: Literal["auto", "atomic", "separate", "stored"] = "auto"
        """How the backward gets dq: fp32 atomics from the dk/dv pass (five MMAs per tile pair), or a
        second, query-major pass (seven MMAs, no atomics, no fp32 buffer), or ``stored``: the dk/dv pass
        writes its score gradients and a second pass reads them (five MMAs, ~2 bytes a pair each way;
        :mod:`gem_kernels.attention_stored`; calls with a relative bias or a window recompute). ``auto``
        takes ``stored`` from ~6e7 (query, key) pairs up (``STORED_BY_DEFAULT``; before it the separate pass,
        faster there than atomics), and atomics on small batches (see
        ``gem_kernels.attention_triton_autograd.ATOMIC_DQ_BELOW_PAIRS`` for the measurements)."""
        block_m: int | None = None
        """Query rows per tile; set together with ``block_n`` to skip autotuning."""
        block_n: int | None = None
        """Keys per tile."""
        fuse_block: Literal["auto", "on", "off"] = "auto"
        """Run the HSTU block's pointwise work fused around its two GEMMs (:mod:`gem_kernels.hstu_block`:
        the input layer norm with its residual branch, and silu, split, attention and norm-gate as one
        function; benchmarks/results/e2e_ab.md measures it). ``auto``: when ``kernels.norm_gate`` is
        ``triton`` too (the fused path is that kernel's math); ``on``: the same, and any other
        norm-gate kernel is an error; ``off``: the ops run one by one."""
        fp8_forward: bool = False
        """The forward's scores ``q k^T`` as an fp8 MMA: ``q`` and ``k`` in e4m3 with one power-of-two scale per
        token and head, fp32 accumulation, the scales applied to the scores in fp32; ``silu``, the mask, the
        biases and ``silu(s) v`` as before (bf16). Each e4m3 value keeps 3 mantissa bits (within 2**-4 of
        the value), so each score moves by up to ~2**-3 of ``sum_d |q_d k_d|``, and the output by as much
        through the silu: a few percent relative error per layer on random data, against ~0.3 % for
        bf16. The backward is unchanged: it reads the bf16 ``q``, ``k``, ``v`` that the forward saves, so
        the attention's gradients are the bf16 attention's (for the output gradient it receives), while
        the output, and all that follows it up to the loss, come from fp8. In the
        fused block the silu pass writes the e4m3 copies (no extra pass); called alone, one Triton pass
        quantizes ``q`` and ``k`` first. Needs bf16 or fp16 activations; not with ``torch.compile`` yet
        (refused). Under the fused block's e4m3 saved format one more pass quantizes ``q``, ``k``. See
        :mod:`gem_kernels.attention_fp8`."""
        bias_grad_in_gap: bool = True
        """In the fused block, the gradient of the ``uvqk`` projection's bias is summed by the gap's backward
        passes as they write the projection's output gradient, instead of by one more pass over that
        gradient after them (:mod:`gem_kernels.hstu_gap_bias`). On by default since 2026-12-04: on an H200
        the step ran 1.007-1.008x the step without it in steady rounds on four inputs (big config and its
        second mix; 1.007x batch by batch where no differently allocating variant ran beside it), after
        its one-pass kernel got 16 warps (``benchmarks/results/e2e_ab.md``)."""

        @model_validator(mode="after")
        def _blocks(self) -> TritonJaggedAttention.Config:
            sizes = (self.block_m, self.block_n)
            if (self.block_m is None) != (self.block_n is None):
                raise ValueError("block_m and block_n are set together (or neither, to autotune)")
            for size in sizes:
                if size is not None and (size < 16 or size > 256 or size & (size - 1)):
                    raise ValueError(f"block sizes must be powers of two in 16..256, got {size}")
            return self

    config: Config

    def check_available(self, device: torch.device) -> None:
        require_triton(device, op=self.op, name=self.name)

    def fused_block(self, norm_gate: NormGateKernel) -> Callable[..., torch.Tensor] | None:
        from gem_kernels.norm_gate import TritonNormGate

        if self.config.fuse_block == "off":
            return None
        if not isinstance(norm_gate, TritonNormGate):
            if self.config.fuse_block == "on":
                raise ValueError(
                    f"kernels.jagged_attention.options.fuse_block=on fuses the norm-gate of kernels.norm_gate "
                    f"'triton', but kernels.norm_gate is {norm_gate.name!r}; set kernels.norm_gate=triton, or "
                    "fuse_block to auto or off"
                )
            return None
        return self._block

    def _block(self, x: torch.Tensor, uvqk: Callable[[torch.Tensor], torch.Tensor],
               out: Callable[[torch.Tensor], torch.Tensor], gate_weight: torch.Tensor, gate_bias: torch.Tensor,
               seq_offsets: torch.Tensor, *, extras: AttentionExtras = NO_EXTRAS, **options: Any) -> torch.Tensor:  # fmt: skip
        num_targets = extras.num_targets
        check_time_inputs(x, extras)
        require_triton(x.device, op=self.op, name=self.name, in_call=True)
        from gem_kernels.hstu_block import hstu_block_triton

        if seq_offsets.dim() != 1 or seq_offsets.is_floating_point():
            raise ValueError(f"jagged_attention: seq_offsets must be integer [B + 1], got {seq_offsets.dtype}")
        if num_targets is not None and num_targets.shape != (seq_offsets.numel() - 1,):
            raise ValueError(f"jagged_attention: num_targets must be [B], got {tuple(num_targets.shape)}")
        blocks = None
        if self.config.block_m is not None and self.config.block_n is not None:
            blocks = (self.config.block_m, self.config.block_n)
        return hstu_block_triton(x, uvqk, out, gate_weight, gate_bias, seq_offsets, extras=extras,
                                 dq_mode=self.config.dq, blocks=blocks, fp8_forward=self.config.fp8_forward,
                                 bias_grad_in_gap=self.config.bias_grad_in_gap, **options)  # fmt: skip

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        *,
        max_seq_len: int,
        alpha: float,
        extras: AttentionExtras = NO_EXTRAS,
    ) -> torch.Tensor:
        check_attention_inputs(q, k, v, seq_offsets, extras, max_seq_len)
        check_time_inputs(q, extras)
        num_targets, max_attn_len = extras.num_targets, extras.max_attn_len
        position_bias, time_bias = extras.position_bias, extras.time_bias
        timestamps, query_timestamps = extras.timestamps, extras.query_timestamps
        for name, table in (("position_bias", position_bias), ("time_bias", time_bias)):
            if table is not None and not table.is_floating_point():
                raise ValueError(f"jagged_attention: {name} must be floating point, got {table.dtype}")
        require_triton(q.device, op=self.op, name=self.name, in_call=True)
        if q.dtype not in TRITON_DTYPES:
            raise KernelUnavailableError(
                f"kernels.{self.op}: 'triton' takes float32, bfloat16 or float16 inputs, got {q.dtype}"
            )
        others = [t for t in (k, v, seq_offsets, num_targets, position_bias, time_bias, timestamps, query_timestamps)
                  if t is not None and t.device != q.device]
        if others:
            raise ValueError(f"jagged_attention: all inputs must be on {q.device}, found {others[0].device}")
        blocks = None
        if self.config.block_m is not None and self.config.block_n is not None:
            blocks = (self.config.block_m, self.config.block_n)
        if torch.compiler.is_compiling():  # dynamo must not trace into the launchers: a custom op
            if self.config.fp8_forward:
                raise ValueError(
                    "kernels.jagged_attention.options.fp8_forward is not available under torch.compile yet (its "
                    "custom op has no fp8 mode); set fp8_forward=false or run without compile"
                )
            from gem_kernels.compiled_ops import jagged_attention_op

            block_m, block_n = blocks if blocks is not None else (0, 0)
            return jagged_attention_op(
                q, k, v, seq_offsets.contiguous(), None if num_targets is None else num_targets.contiguous(),
                position_bias, time_bias, timestamps, query_timestamps, max_seq_len, float(alpha), max_attn_len,
                self.config.dq, block_m, block_n,
            )
        from gem_kernels.attention_triton_autograd import jagged_attention_triton

        return jagged_attention_triton(q, k, v, seq_offsets, max_seq_len=max_seq_len, alpha=alpha, extras=extras,
                                       dq_mode=self.config.dq, blocks=blocks,
                                       fp8_forward=self.config.fp8_forward)  # fmt: skip
