"""``quantized``: fewer bytes on the wire, for dense gradients and for the embedding all-to-all.

Dense gradients (a DDP comm hook, ``accumulate: fp32``, the default): every bucket is divided by
the world size and cast to bf16 (or fp16), then

1. an all-to-all hands rank ``j`` the ``j``-th chunk of every rank's bucket (bf16 on the wire);
2. each rank sums its chunk's ``w`` pieces in float32, in rank order, and casts the sum to bf16;
3. an all-gather of those bf16 chunks gives every rank the same reduced bucket.

That is a reduce-scatter + all-gather with 16-bit transfers and float32 accumulation, so the bytes
sent are half of a float32 ring all-reduce, and rounding happens twice (the inputs and the reduced
sum), never inside the sum. ``accumulate: wire`` uses torch's ``bf16_compress_hook`` /
``fp16_compress_hook`` instead: one all-reduce in 16 bits, which also sums in 16 bits (the backend's
reduction runs in the wire dtype).

The embedding all-to-all: :meth:`QuantizedComm.embedding_qcomms` returns torchrec's
``QCommsConfig`` (``forward`` / ``backward``: ``fp32``, ``bf16``, ``fp16``, ``fp8``), which the
``torchrec_ddp`` planner hands to its sharders' codec registry. On the CPU, FBGEMM's bf16 and fp16
codecs run; its fp8 codec does not ("fp8 is not supported by CPU"), so fp8 is refused there when
the sharders are built. fp8 needs ``fp8_quantize_dim`` (the row length it scales over) on CUDA.
"""

# no ``from __future__ import annotations``: DDP checks a comm hook's annotations as objects
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from gem_comm._base import MeasuredComm, done, flat_padded
from gem_comm.measure import CommMeter, all_gather_bytes, ring_all_reduce_bytes, scatter_bytes
from gem_model.api import ComponentConfig

WireDtype = Literal["bf16", "fp16"]
EmbeddingPrecision = Literal["fp32", "bf16", "fp16", "fp8"]
_TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


class QuantizedConfig(ComponentConfig):
    dense_dtype: WireDtype = Field("bf16", description="dtype of the dense gradients on the wire")
    accumulate: Literal["fp32", "wire"] = Field(
        "fp32", description="fp32: reduce-scatter + all-gather with float32 sums; wire: torch's 16-bit all-reduce hook"
    )
    embedding_forward: EmbeddingPrecision = Field("bf16", description="torchrec qcomms: embedding all-to-all forward")
    embedding_backward: EmbeddingPrecision = Field("bf16", description="torchrec qcomms: its gradient all-to-all")
    fp8_quantize_dim: int | None = Field(None, gt=0, description="torchrec's fp8 row length (the embedding dim)")


class _HookState:
    def __init__(self, group: dist.ProcessGroup, meter: CommMeter, dtype: torch.dtype):
        self.group, self.meter, self.dtype = group, meter, dtype


def fp32_accumulating_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket's mean over ``state.group``, 16 bits on the wire, summed in float32."""
    group, world = state.group, dist.get_world_size(state.group)
    buffer = bucket.buffer()
    wire = flat_padded(buffer.div(world), world, state.dtype)
    received = torch.empty_like(wire)
    nbytes = wire.numel() * wire.element_size()
    with state.meter.timed("dense.all_to_all", scatter_bytes(nbytes, world)):
        dist.all_to_all_single(received, wire, group=group)
    chunk = received.view(world, -1).float().sum(dim=0).to(state.dtype)
    gathered = torch.empty_like(wire)
    with state.meter.timed("dense.all_gather", all_gather_bytes(chunk.numel() * chunk.element_size(), world)):
        dist.all_gather_into_tensor(gathered, chunk, group=group)
    buffer.copy_(gathered[: buffer.numel()])
    return done(buffer)


def _wire_hook(dtype: torch.dtype) -> Any:
    torch_hook = default_hooks.bf16_compress_hook if dtype == torch.bfloat16 else default_hooks.fp16_compress_hook

    def hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        world = dist.get_world_size(state.group)
        nbytes = bucket.buffer().numel() * torch.empty((), dtype=dtype).element_size()
        state.meter.record("dense.all_reduce", ring_all_reduce_bytes(nbytes, world))  # asynchronous: not timed
        return torch_hook(state.group, bucket)

    return hook


class QuantizedComm(MeasuredComm):
    name: ClassVar[str] = "quantized"
    Config = QuantizedConfig
    shapes_run: ClassVar[bool | frozenset[str]] = True  # lower-precision gradients change the update
    config: QuantizedConfig

    def configure_ddp(self, ddp: DistributedDataParallel) -> None:
        group = self._ddp_group(ddp)
        dtype = _TORCH_DTYPE[self.config.dense_dtype]
        hook = fp32_accumulating_hook if self.config.accumulate == "fp32" else _wire_hook(dtype)
        ddp.register_comm_hook(_HookState(group, self.meter, dtype), hook)

    def embedding_qcomms(self) -> Any:
        from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig

        cfg = self.config
        device = getattr(getattr(self, "env", None), "device", None)
        if "fp8" in (cfg.embedding_forward, cfg.embedding_backward) and device is not None and device.type == "cpu":
            raise ValueError(
                "comm.strategy 'quantized': comm.strategy.options.embedding_forward/embedding_backward 'fp8' cannot "
                "run on the CPU (FBGEMM's fp8 codec: 'fp8 is not supported by CPU'); use bf16 or fp16 there"
            )
        return QCommsConfig(
            forward_precision=CommType(cfg.embedding_forward),
            backward_precision=CommType(cfg.embedding_backward),
            fp8_quantize_dim=cfg.fp8_quantize_dim,
            fp8_quantize_dim_bwd=cfg.fp8_quantize_dim,
        )
