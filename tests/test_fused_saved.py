"""``fp8_saved`` on the fused HSTU block (gem-precision's policy, gem-kernels' kernels, the core's
``gem_model.saved_format`` between them), in Triton's interpreter:

- the e4m3 rows the fused gap keeps are gem-precision's reference row quantizer's bytes and scales,
  bit for bit, on random data and on its edge cases (zeros, subnormals, infinities, NaN, ties);
- on the fused path the policy installs no saved-tensor hook (not one pack call), and off it (fuse
  off) its hooks compress as before; the decision is taken per forward;
- what the block keeps for backward, counted from outside the block by saved-tensor hooks and by the
  profile's live-storage meter, falls by exactly the bytes of ``pre``, ``silu(v, q, k)`` and the
  attention output less their e4m3 rows and scales.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch

from gem_kernels.attention import TritonJaggedAttention
from gem_kernels.hstu_gap_saved import silu_quantize_rows
from gem_kernels.norm_gate import TritonNormGate
from gem_kernels.testing import offsets_from_lengths
from gem_model.model.hstu import HSTUBlock
from gem_model.profiling.memory import LiveBytes
from gem_precision.activation import Fp8SavedPolicy, NoActivationPolicy
from gem_precision.checks import compare_operands, summarize
from gem_precision.formats import E4M3
from gem_precision.fp8_reference import Fp8Operand, quantize_fp8_reference
from gem_precision.saved_tensors import CountSavedTensors
from gem_precision.testing import counting_packs, mx_edge_cases, wide_range_randn

DIM, HEADS, D = 32, 2, 16
WIDTH, HV = HEADS * 4 * D, HEADS * D


def kept_rows(x: torch.Tensor, chunk: int | None) -> Fp8Operand:
    hv = x.shape[1] // 4
    data, scale_inv = silu_quantize_rows(x, torch.empty(x.shape[0], x.shape[1] - hv, dtype=x.dtype), hv, chunk=chunk)
    return Fp8Operand(data, scale_inv.view(-1, 1))


# the interpreter's numpy warns on the edge cases' infinities and NaN (silu of them, and their scaling)
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
@pytest.mark.parametrize("chunk", [None, 32], ids=["whole rows", "rows in chunks"])
def test_the_kept_rows_are_the_reference_quantizers_bytes(chunk: int | None) -> None:
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    cases = {**mx_edge_cases(), "wide": wide_range_randn(9, 100, generator=gen),
             "bf16": torch.randn(6, 128, generator=gen).mul(3).to(torch.bfloat16)}  # fmt: skip
    for name, x in cases.items():
        want = quantize_fp8_reference(x, granularity="row", fmt=E4M3).rows
        diffs = compare_operands(name, kept_rows(x, chunk), want, source=x)
        assert not diffs, summarize(diffs)


def fused_block() -> HSTUBlock:
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    attention = TritonJaggedAttention(TritonJaggedAttention.Config(fuse_block="on"))
    return HSTUBlock(dim=DIM, num_heads=HEADS, attention_dim=D, value_dim=D, max_seq_len=16, max_attn_len=0,
                     alpha=0.25, dropout=0.0, attention=attention, norm_gate=TritonNormGate())  # fmt: skip


OFFSETS = offsets_from_lengths([6, 0, 9])
TOKENS = int(OFFSETS[-1])


def train_step(block: HSTUBlock) -> None:
    x = torch.randn(TOKENS, DIM).requires_grad_()
    block(x, OFFSETS, None).sum().backward()


def test_fp8_saved_uses_no_hooks_on_the_fused_block_and_hooks_off_it() -> None:
    policy = Fp8SavedPolicy(Fp8SavedPolicy.Config(min_numel=64))
    block = policy.wrap_block(fused_block(), "blocks.0")
    assert block.saved_format == "e4m3_row" and block.saves_in_kernels()
    kept: list[torch.dtype] = []
    with counting_packs() as packed, torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.dtype) or t,
                                                                              lambda t: t):  # fmt: skip
        train_step(block)
    assert packed == [] and policy.stats.kernel_forwards == 1 and policy.stats.tensors == 0
    assert torch.float8_e4m3fn in kept  # the gap's rows, seen from outside the block
    block.fuse = False  # the next forward composes the ops: the hooks compress it
    assert not block.saves_in_kernels()
    with counting_packs() as packed:
        train_step(block)
    assert len(packed) > 0 and policy.stats.compressed > 0 and policy.stats.kernel_forwards == 1


def saved_bytes(block: HSTUBlock) -> tuple[int, int]:
    """What the block keeps for backward, counted outside it: (saved-tensor hooks' distinct storages,
    the profile's live storages created by the forward, less its output)."""
    x = torch.randn(TOKENS, DIM, dtype=block.uvqk.weight.dtype).requires_grad_()
    counter = CountSavedTensors()
    with counter.hooks(), LiveBytes() as meter:
        y = block(x, OFFSETS, None)
        gc.collect()  # Triton's interpreter leaves its arguments' storages in reference cycles
        live = meter.live - y.untyped_storage().nbytes()
    y.sum().backward()
    return counter.stats.bytes_stored, live


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kept_bytes_are_counted_where_the_profile_counts(dtype: torch.dtype) -> None:
    plain = fused_block().to(dtype)
    compressed = Fp8SavedPolicy().wrap_block(copy.deepcopy(plain), "blocks.0")
    NoActivationPolicy().wrap_block(plain, "blocks.0")
    size = torch.finfo(dtype).bits // 8
    # pre [L, W], silu(v, q, k) [L, W - H Dv] and the attention output [L, H Dv] as computed, against
    # e4m3 rows and a float32 scale per row of pre and of the attention output
    fewer = TOKENS * (WIDTH * size + (WIDTH - HV) * size + HV * size) - TOKENS * (WIDTH + 4) - TOKENS * (HV + 4)
    # and the block's input x [L, DIM], which the layer norm then does not keep (its backward reads ln,
    # which uvqk keeps anyway): fewer saved storages; the live meter counts only what the forward
    # created, and x was made before it
    x_bytes = TOKENS * DIM * size
    (hooks_plain, live_plain), (hooks_fp8, live_fp8) = saved_bytes(plain), saved_bytes(compressed)
    assert hooks_plain - hooks_fp8 == fewer + x_bytes
    assert live_plain - live_fp8 == fewer
