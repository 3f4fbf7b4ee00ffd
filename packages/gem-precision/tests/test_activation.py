"""Activation policies: same outputs and gradients as the unwrapped block (fp8_saved within its
stated tolerance), parameters untouched, and fp8_saved stores fewer bytes for backward."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from gem_model.api import E4M3_ROW, SavedFormatBlock
from gem_precision.activation import (
    CheckpointFullPolicy,
    CheckpointSelectivePolicy,
    Fp8SavedPolicy,
    NoActivationPolicy,
)
from gem_precision.saved_tensors import CountSavedTensors, Fp8SavedTensors
from gem_precision.schemes import Bf16Scheme, Fp8RowwiseScheme, MXFP8Scheme
from gem_precision.testing import HstuLikeBlock, counting_packs, rel_err

# e4m3 keeps 3 mantissa bits (~2**-5 relative error per saved element on average); a parameter
# gradient sums products of several rounded tensors (~8% at worst over 20 seeds on this block)
FP8_SAVED_TOL = 0.15
FP8_TWICE_TOL = 0.2
"""fp8_saved's saved activations under fp8_rowwise's linears: two e4m3 roundings of the same values. Over
seeds 0-399 the largest gradient error was 0.124 (median 0.080), always in the layer norm's 64-wide
weight or bias gradient; one local run failed at 0.15 on 2026-12-06 (its seed was not kept). A broken
composition is off by the order of 1."""
SMALL = {"min_numel": 1024}


def grads(block: nn.Module, x: torch.Tensor, gy: torch.Tensor) -> list[torch.Tensor]:
    x = x.detach().clone().requires_grad_(True)
    y = block(x)
    y.backward(gy)
    return [y.detach(), x.grad, *(p.grad for p in block.parameters())]


@pytest.fixture
def setup(gen: torch.Generator) -> tuple[HstuLikeBlock, torch.Tensor, torch.Tensor]:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    block = HstuLikeBlock(64)
    return block, torch.randn(256, 64, generator=gen), torch.randn(256, 64, generator=gen)


@pytest.mark.parametrize(
    ("policy", "tol"),
    [
        (NoActivationPolicy(), 0.0),
        (CheckpointFullPolicy(), 0.0),
        (CheckpointSelectivePolicy(), 0.0),
        (Fp8SavedPolicy(Fp8SavedPolicy.Config(**SMALL)), FP8_SAVED_TOL),
        (Fp8SavedPolicy(Fp8SavedPolicy.Config(granularity="row", **SMALL)), FP8_SAVED_TOL),
    ],
    ids=["none", "checkpoint_full", "checkpoint_selective", "fp8_saved_block32", "fp8_saved_row"],
)
def test_outputs_and_gradients_match_unwrapped(setup, policy, tol: float) -> None:
    block, x, gy = setup
    want = grads(copy.deepcopy(block), x, gy)
    wrapped = policy.wrap_block(copy.deepcopy(block), "blocks.0")
    got = grads(wrapped, x, gy)
    assert rel_err(got[0], want[0]) == 0  # the forward itself is never changed
    for g, w in zip(got[1:], want[1:]):
        assert rel_err(g, w) <= tol


@pytest.mark.parametrize("cls", [NoActivationPolicy, CheckpointFullPolicy, CheckpointSelectivePolicy, Fp8SavedPolicy])
def test_wrapping_keeps_the_block_and_its_names(cls: type, setup) -> None:
    block = setup[0]
    keys = list(block.state_dict())
    wrapped = cls().wrap_block(block, "blocks.0")
    assert wrapped is block and list(wrapped.state_dict()) == keys
    if cls is not NoActivationPolicy:
        with pytest.raises(ValueError, match=r"blocks\.0: block already has activation policy"):
            cls().wrap_block(block, "blocks.0")
    copy.deepcopy(wrapped)(torch.randn(3, 64)).sum().backward()  # a copy runs on its own weights
    with torch.no_grad():
        assert wrapped(torch.randn(3, 64)).shape == (3, 64)


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def backward_ops(block: nn.Module, x: torch.Tensor) -> dict[str, int]:
    y = block(x.clone().requires_grad_(True))
    with CountOps() as mode:
        y.sum().backward()
    return mode.counts


def test_selective_recomputes_pointwise_but_not_gemms(setup) -> None:
    block, x, _ = setup
    plain = backward_ops(copy.deepcopy(block), x)
    full = backward_ops(CheckpointFullPolicy().wrap_block(copy.deepcopy(block), "b"), x)
    selective = backward_ops(CheckpointSelectivePolicy().wrap_block(copy.deepcopy(block), "b"), x)
    gemms = ("mm", "addmm")
    assert sum(full.get(op, 0) for op in gemms) > sum(plain.get(op, 0) for op in gemms)
    assert sum(selective.get(op, 0) for op in gemms) == sum(plain.get(op, 0) for op in gemms)
    assert selective.get("silu", 0) > plain.get("silu", 0)  # pointwise forward ops run again


def test_selective_rejects_unknown_op() -> None:
    with pytest.raises(ValueError, match="unknown aten op 'matmul_fast'"):
        CheckpointSelectivePolicy.Config(save_ops=("mm", "matmul_fast"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("granularity", ["block32", "row"])
def test_fp8_saved_lowers_saved_bytes(setup, dtype: torch.dtype, granularity: str) -> None:
    block, x, _ = setup
    block, x = block.to(dtype), x.to(dtype)
    baseline = CountSavedTensors()
    with baseline.hooks():
        copy.deepcopy(block)(x.clone().requires_grad_(True))
    policy = Fp8SavedPolicy(Fp8SavedPolicy.Config(granularity=granularity, **SMALL))
    policy.wrap_block(block, "b")(x.clone().requires_grad_(True))
    stats = policy.stats
    assert stats.bytes_in == baseline.stats.bytes_in  # both count the same storages
    assert stats.compressed >= 6
    # the weights (kept as they are) are part of both counts
    params = sum(p.numel() * p.element_size() for p in block.parameters())
    reduction = 1 - (stats.bytes_stored - params) / (stats.bytes_in - params)
    assert reduction > (0.70 if dtype == torch.float32 else 0.45)


def test_fp8_saved_never_compresses_parameters_or_integers(gen: torch.Generator) -> None:
    linear = Bf16Scheme().convert_linear(nn.Linear(64, 64), "p")  # saves a bfloat16 cast of its weight
    emb = nn.Embedding(100, 64)
    codec = Fp8SavedTensors(granularity="block32", min_numel=16, parameters=[*linear.parameters(), *emb.parameters()])
    ids = torch.randint(0, 100, (50,), generator=gen)
    packed: list[object] = []

    def pack(t: torch.Tensor) -> object:
        packed.append(codec.pack(t))
        return packed[-1]

    with torch.autograd.graph.saved_tensors_hooks(pack, codec.unpack):
        out = linear(emb(ids)).sum()
    assert torch.equal(packed[0], ids) or any(p is ids for p in packed)  # integer ids kept as they are
    for p in packed:
        if isinstance(p, torch.Tensor) and p.dtype == torch.bfloat16 and p.shape == (64, 64):
            break
    else:
        raise AssertionError("the bfloat16 weight cast was not kept as it is")
    assert codec.stats.compressed == 1  # only the embedding output (the linear's input)
    out.backward()
    assert linear.weight.grad is not None


def test_fp8_saved_keeps_tiny_tensors(setup) -> None:
    block, x, gy = setup
    policy = Fp8SavedPolicy(Fp8SavedPolicy.Config(min_numel=256 * 256 + 1))  # above every tensor here
    got = grads(policy.wrap_block(copy.deepcopy(block), "b"), x, gy)
    want = grads(copy.deepcopy(block), x, gy)
    assert policy.stats.compressed == 0
    for g, w in zip(got, want):
        assert rel_err(g, w) == 0


@pytest.mark.parametrize("policy_cls", [CheckpointFullPolicy, CheckpointSelectivePolicy, Fp8SavedPolicy])
@pytest.mark.parametrize("scheme_cls", [Bf16Scheme, Fp8RowwiseScheme, MXFP8Scheme], ids=lambda c: c.name)
def test_policies_compose_with_converted_linears(setup, policy_cls: type, scheme_cls: type) -> None:
    block, x, gy = setup
    scheme = scheme_cls()
    for name in ("uvqk", "out"):  # what the core does first: precision, then the activation policy
        setattr(block, name, scheme.convert_linear(getattr(block, name), f"blocks.0.{name}"))
    want = grads(copy.deepcopy(block), x, gy)
    policy = policy_cls(policy_cls.Config(**SMALL)) if policy_cls is Fp8SavedPolicy else policy_cls()
    got = grads(policy.wrap_block(copy.deepcopy(block), "blocks.0"), x, gy)
    tol = (FP8_TWICE_TOL if scheme_cls is Fp8RowwiseScheme else FP8_SAVED_TOL) if policy_cls is Fp8SavedPolicy else 0.0
    assert rel_err(got[0], want[0]) == 0
    for g, w in zip(got[1:], want[1:]):
        assert rel_err(g, w) <= tol


class SelfCompressingBlock(HstuLikeBlock):
    """Stands in for a block whose kernels can store what they save (gem_model.saved_format): the HSTU
    block on gem-kernels' fused path. ``fused`` says whether its forward takes that path now; it computes
    the same either way (the stand-in's kernels compress nothing)."""

    def __init__(self, dim: int):
        super().__init__(dim)
        self.saved_format: str | None = None
        self.fused = True

    def saves_in_kernels(self) -> bool:
        return self.fused and self.saved_format is not None


def test_fp8_saved_leaves_a_self_compressing_forward_to_its_kernels(gen: torch.Generator) -> None:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    block = SelfCompressingBlock(64)
    assert isinstance(block, SavedFormatBlock)
    x, gy = torch.randn(96, 64, generator=gen), torch.randn(96, 64, generator=gen)
    want = grads(copy.deepcopy(block), x, gy)
    policy = Fp8SavedPolicy(Fp8SavedPolicy.Config(**SMALL))
    wrapped = policy.wrap_block(block, "blocks.0")
    assert wrapped.saved_format == E4M3_ROW
    with counting_packs() as packed:
        got = grads(wrapped, x, gy)
    assert packed == [] and policy.stats.kernel_forwards == 1 and policy.stats.tensors == 0
    assert all(torch.equal(g, w) for g, w in zip(got, want))  # nothing of the policy ran
    wrapped.fused = False  # decided per forward: off the self-compressing path, the hooks compress
    with counting_packs() as packed:
        grads(wrapped, x, gy)
    assert len(packed) > 0 and policy.stats.compressed > 0 and policy.stats.kernel_forwards == 1


def test_fp8_saved_without_in_kernels_uses_hooks_everywhere(gen: torch.Generator) -> None:
    block = SelfCompressingBlock(64)
    policy = Fp8SavedPolicy(Fp8SavedPolicy.Config(in_kernels=False, **SMALL))
    wrapped = policy.wrap_block(block, "blocks.0")
    assert wrapped.saved_format is None and not wrapped.saves_in_kernels()
    with counting_packs() as packed:
        grads(wrapped, torch.randn(96, 64, generator=gen), torch.randn(96, 64, generator=gen))
    assert len(packed) > 0 and policy.stats.kernel_forwards == 0
