"""The kernels added for the saved-tensor codec and the transposed MX operand (under
TRITON_INTERPRET=1): one-warp column MX kernel and one-pass fp8 row kernels bit-identical to the
references; and the codec frees each packed copy once its backward node has run."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from gem_precision.checks import check_mx_quantization, compare_operands, summarize
from gem_precision.formats import E4M3
from gem_precision.fp8_reference import quantize_fp8_reference
from gem_precision.fp8_rows_triton import dequantize_fp8_rows_triton, quantize_fp8_rows_triton
from gem_precision.mx_triton import mx_quantize_triton
from gem_precision.saved_tensors import Fp8SavedTensors
from gem_precision.testing import mx_edge_cases, wide_range_randn

COLUMN_TILES = [(0, 32, 1), (0, 32, 3), (0, 64, 2)]


@pytest.mark.parametrize("tile", COLUMN_TILES, ids=str)
@pytest.mark.parametrize("rows", [False, True], ids=["cols_t", "both"])
def test_column_kernel_edge_cases(tile: tuple[int, int, int], rows: bool) -> None:
    diffs = check_mx_quantization(mx_edge_cases(), software_round=True, rows=rows, tile=tile)
    assert not diffs, summarize(diffs)


@pytest.mark.parametrize("tile", COLUMN_TILES, ids=str)
@pytest.mark.parametrize("shape", [(96, 130), (36, 200), (100, 64), (37, 45)])  # words and byte stores
def test_column_kernel_random(gen: torch.Generator, tile: tuple[int, int, int], shape: tuple[int, int]) -> None:
    cases = {
        "bf16": torch.randn(*shape, generator=gen).to(torch.bfloat16),
        "wide": wide_range_randn(*shape, generator=gen),
    }
    diffs = check_mx_quantization(cases, software_round=True, tile=tile)
    assert not diffs, summarize(diffs)


def test_column_kernel_rejects_rows_only() -> None:
    with pytest.raises(ValueError, match="column kernel"):
        mx_quantize_triton(torch.zeros(32, 32), rows=True, cols_t=False, tile=(0, 32, 1))


@pytest.mark.parametrize("shape", [(33, 70), (5, 4100), (64, 512), (3, 32)])  # one chunk and several
def test_fp8_rows_kernel_bit_identical(gen: torch.Generator, shape: tuple[int, int]) -> None:
    for x in (wide_range_randn(*shape, generator=gen), torch.randn(*shape, generator=gen).to(torch.bfloat16)):
        want = quantize_fp8_reference(x, granularity="row", fmt=E4M3).rows
        got = quantize_fp8_rows_triton(x)
        diffs = compare_operands("rows", got, want, source=x)
        assert not diffs, summarize(diffs)
        back = dequantize_fp8_rows_triton(got, x.dtype)
        assert back.dtype == x.dtype and torch.equal(back, want.dequantize(x.dtype))


def test_fp8_rows_kernel_edge_cases() -> None:
    for name, x in mx_edge_cases().items():
        diffs = compare_operands(
            name, quantize_fp8_rows_triton(x), quantize_fp8_reference(x, granularity="row", fmt=E4M3).rows
        )
        assert not diffs, summarize(diffs)


@pytest.mark.parametrize("granularity", ["block32", "row"])
def test_packed_copies_are_freed_during_backward(gen: torch.Generator, granularity: str) -> None:
    """Each packed copy dies with the node that saved it, not at the end of backward."""
    codec = Fp8SavedTensors(granularity=granularity, min_numel=1, parameters=[])
    x = torch.randn(64, 64, generator=gen, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(codec.pack, codec.unpack):
        h1 = torch.sin(x)  # saves x
        h2 = torch.sin(h1)  # saves h1
        y = torch.sin(h2).sum()  # saves h2
    packed = [ref for _, ref in codec._packed.values()]
    assert len(packed) == 3 and all(r() is not None for r in packed)
    alive_when_h1_grad_arrives: list[int] = []
    h1.register_hook(lambda g: alive_when_h1_grad_arrives.append(sum(r() is not None for r in packed)))
    y.backward()
    # by the time d/dh1 exists, the nodes that saved h2 and h1 have run: only x's copy remains
    assert alive_when_h1_grad_arrives == [1]
    del y, h1, h2
    gc.collect()
    assert all(r() is None for r in packed)
    assert isinstance(weakref.ref(codec), weakref.ref)  # the codec itself holds no packed copy


@pytest.mark.parametrize("granularity", ["block32", "row"])
def test_codec_triton_path_gives_the_reference_gradients(
    gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, granularity: str
) -> None:
    """The CUDA branch of the codec (Triton kernels, here interpreted) and the CPU branch (torch
    references) store the same bits, so the gradients are identical."""
    import copy

    from gem_precision import saved_tensors
    from gem_precision.activation import Fp8SavedPolicy
    from gem_precision.testing import HstuLikeBlock

    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    block = HstuLikeBlock(64)
    x, gy = torch.randn(96, 64, generator=gen), torch.randn(96, 64, generator=gen)
    grads = []
    for triton_path in (False, True):
        monkeypatch.setattr(saved_tensors, "use_triton", lambda t, on=triton_path: on)
        policy = Fp8SavedPolicy(Fp8SavedPolicy.Config(granularity=granularity, min_numel=1024))
        wrapped = policy.wrap_block(copy.deepcopy(block), "b")
        xi = x.clone().requires_grad_(True)
        wrapped(xi).backward(gy)
        grads.append([xi.grad, *(p.grad for p in wrapped.parameters())])
        assert policy.stats.compressed > 0
    for a, b in zip(*grads):
        assert torch.equal(a, b)
