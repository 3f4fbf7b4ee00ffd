"""The e4m3 copies of q and k that the fp8 attention forward reads (gem_kernels.attention_fp8) are, bit for
bit, gem-precision's row quantizer applied to each (token, head) of the q and k they stand for: the
plain path's Triton pass over q and k, and the fused gap's silu pass, which quantizes the bf16
``silu(pre)`` it writes (and writes it as the plain silu pass does).

Fresh random data with a head of zeros, a head holding an infinity and one holding a NaN, a head dim that
is not a power of two (masked columns), and gem-precision's edge cases. Triton runs in its interpreter
(the root conftest.py sets it on a machine without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from gem_kernels.attention_fp8 import quantize_qk, silu_quantize_qk
from gem_kernels.hstu_gap_triton import silu_columns
from gem_precision.formats import E4M3
from gem_precision.fp8_reference import quantize_fp8_reference
from gem_precision.testing import mx_edge_cases

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf, on purpose


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def assert_reference_bits(data: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> None:
    """``data`` ``[L, H, D]`` e4m3 and ``scales`` ``[L, H]`` are the row quantization of ``x.reshape(L H, D)``."""
    rows, heads, dim = x.shape
    want = quantize_fp8_reference(x.reshape(rows * heads, dim), granularity="row", fmt=E4M3).rows
    assert want is not None
    assert torch.equal(data.reshape(rows * heads, dim).view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(scales.reshape(-1).view(torch.int32), want.scale_inv.reshape(-1).view(torch.int32))  # NaN bits


def with_special_heads(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x[1, 0] = 0  # a head of zeros
    x[2, 1, 5] = float("inf")
    x[-1, 2, 0] = float("nan")  # in the last program
    return x


def test_the_quantize_pass_writes_the_reference_bits(gen: torch.Generator) -> None:
    q = with_special_heads(torch.randn(11, 3, 40, generator=gen) * 3).bfloat16()
    k = (torch.randn(11, 3, 40, generator=gen) * torch.rand(11, 3, 1, generator=gen) * 50).bfloat16()
    q8, k8, scales = quantize_qk(q, k)
    assert_reference_bits(q8, scales[..., 0], q)
    assert_reference_bits(k8, scales[..., 1], k)


def test_every_branch_of_the_rule_gives_the_reference_bits() -> None:
    """gem-precision's edge cases (zeros, subnormals, powers of two and just below, amaxes at and above
    1.75 * 2**k, infinities, NaN, huge next to tiny, rounding ties), one (token, head) per row, float32."""
    rows = torch.cat([t for t in mx_edge_cases().values() if t.shape[1] == 64])
    x = rows.reshape(-1, 1, 64)
    q8, k8, scales = quantize_qk(x, x.flip(0))
    assert_reference_bits(q8, scales[..., 0], x)
    assert_reference_bits(k8, scales[..., 1], x.flip(0))


def test_the_gap_silu_pass_quantizes_what_it_writes(gen: torch.Generator) -> None:
    rows, heads, dim = 13, 2, 24
    pre = with_special_heads(torch.randn(rows, 2 * heads, dim, generator=gen) * 3).bfloat16().reshape(rows, -1)
    post = torch.full((rows, 2 * heads * dim + 8), float("nan"), dtype=torch.bfloat16)
    q8, k8, scales = silu_quantize_qk(pre, post[:, 8:], heads)
    plain = silu_columns(pre, torch.empty(rows, 2 * heads * dim, dtype=torch.bfloat16))
    assert torch.equal(post[:, 8:].view(torch.int16), plain.view(torch.int16))  # the same post, NaN bits too
    assert post[:, :8].isnan().all()
    written = post[:, 8:].reshape(rows, 2 * heads, dim)
    assert_reference_bits(q8, scales[..., 0], written[:, :heads])
    assert_reference_bits(k8, scales[..., 1], written[:, heads:])
