"""Reference components for testing the core, and any plugin, in isolation.

Nothing here is registered unless a test does it (``GemPluginManager(plugins=[gem_model.testing])``
or ``GEM_PLUGINS=gem_model.testing``). The components are deliberately plain (a per-sequence
attention loop, no sharding) and follow the interface contracts exactly, so a test of one real
plugin package can fill every other seam without installing the sibling packages. Their names
start with ``inline_`` or are kernel names no package uses, so they never clash with real plugins.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torchrec.optim.keyed import KeyedOptimizerWrapper

from gem_model.components import (
    ActivationPolicy,
    CommStrategy,
    ComponentConfig,
    JaggedAttentionKernel,
    NormGateKernel,
    ParallelPlanner,
    PrecisionScheme,
    PreparedModel,
)
from gem_model.jagged import relative_bias_matrix, time_bias_matrix
from gem_model.markers import hookimpl


def hstu_mask(n: int, t: int, window: int, device: torch.device) -> torch.Tensor:
    p = torch.clamp(torch.arange(n, device=device), max=n - t)
    diff = p[:, None] - p[None, :]
    keep = diff > 0
    if window > 0:
        keep &= diff <= window
    return keep | torch.eye(n, dtype=torch.bool, device=device)


class LoopAttention(JaggedAttentionKernel):
    """One sequence at a time: full n x n products per sequence, no padding across sequences."""

    name: ClassVar[str] = "loop"
    supports_position_bias: ClassVar[bool] = True
    supports_time_bias: ClassVar[bool] = True

    def __call__(
        self, q, k, v, seq_offsets, *, max_seq_len, alpha, num_targets=None, max_attn_len=0, position_bias=None,
        time_bias=None, timestamps=None, query_timestamps=None,
    ):
        outs = []
        for b in range(seq_offsets.numel() - 1):
            s, e = int(seq_offsets[b]), int(seq_offsets[b + 1])
            n = e - s
            if n == 0:
                continue
            t = int(num_targets[b]) if num_targets is not None else 0
            scores = torch.einsum("ihd,jhd->hij", q[s:e], k[s:e]) * alpha
            if position_bias is not None:
                scores = scores + relative_bias_matrix(position_bias, n, max_seq_len)
            if time_bias is not None:
                scores = scores + time_bias_matrix(time_bias, query_timestamps[s:e], timestamps[s:e])
            w = F.silu(scores) / max_seq_len * hstu_mask(n, t, max_attn_len, q.device)
            outs.append(torch.einsum("hij,jhd->ihd", w, v[s:e]))
        return torch.cat(outs) if outs else v.new_zeros(v.shape)


class PoisonConfig(ComponentConfig):
    nan_from_call: int = 0


class PoisonAttention(LoopAttention):
    """The loop kernel, returning NaN from its ``nan_from_call``-th call on (to test the NaN stop)."""

    name: ClassVar[str] = "poison"
    Config = PoisonConfig

    def __init__(self, config=None):
        super().__init__(config)
        self.calls = 0

    def __call__(self, q, *args, **kwargs):
        self.calls += 1
        out = super().__call__(q, *args, **kwargs)
        return out * float("nan") if self.calls >= self.config.nan_from_call else out


class TorchNormGate(NormGateKernel):
    name: ClassVar[str] = "loop"

    def __call__(self, x, u, weight, bias, eps):
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps) * u


class Fp32(PrecisionScheme):
    name: ClassVar[str] = "inline_fp32"

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        return linear


class HalfGemm(PrecisionScheme):
    """bf16 GEMMs with fp32 master weights; records which modules it converted."""

    name: ClassVar[str] = "inline_bf16"
    converted: ClassVar[list[str]] = []

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        HalfGemm.converted.append(fqn)
        return _Bf16Linear(linear)


class _Bf16Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = self.bias.bfloat16() if self.bias is not None else None
        return F.linear(x.bfloat16(), self.weight.bfloat16(), b).float()


class NoPolicy(ActivationPolicy):
    name: ClassVar[str] = "inline_none"

    def wrap_block(self, block: nn.Module, fqn: str) -> nn.Module:
        return block


class PlainComm(CommStrategy):
    """Sums with ``all_reduce`` on the default group when one exists; the identity otherwise."""

    name: ClassVar[str] = "inline_comm"

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        if not (dist.is_available() and dist.is_initialized()):
            return values
        out = values.clone()
        dist.all_reduce(out)
        return out

    def all_reduce_mean(self, values: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return self.all_reduce_sum(values) / world


class Single(ParallelPlanner):
    name: ClassVar[str] = "inline_single"
    max_world_size: ClassVar[int | None] = 1

    def prepare(self, model, *, env, comm, sparse_optimizer):
        model.to(env.device)
        sparse = {f"sparse.{n}": p for n, p in model.sparse.named_parameters()}
        dense = [(n, p) for n, p in model.named_parameters() if not n.startswith("sparse.")]
        opt = KeyedOptimizerWrapper(sparse, lambda ps: sparse_optimizer.cls(ps, **sparse_optimizer.kwargs))
        return PreparedModel(module=model, dense_parameters=dense, sparse_optimizer=opt, sparse_optimizer_fused=False)


@hookimpl
def gem_register_kernels():
    return [LoopAttention, PoisonAttention, TorchNormGate]


@hookimpl
def gem_register_precision_schemes():
    return [Fp32, HalfGemm]


@hookimpl
def gem_register_activation_policies():
    return [NoPolicy]


@hookimpl
def gem_register_comm_strategies():
    return [PlainComm]


@hookimpl
def gem_register_parallel_planners():
    return [Single]
