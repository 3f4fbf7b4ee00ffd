"""The fp8 forward of the Triton jagged attention (``fp8_forward``, gem_kernels.attention_fp8).

Tolerance against the float64 reference on the exact inputs, from e4m3's 3 mantissa bits. Round to
nearest puts each quantized value within ``u |x|`` of ``x``, ``u = 2**-4`` (half a spacing of ``2**-3``
relative to its binade); below e4m3's smallest normal ``2**-6`` the spacing is ``2**-9``, and since the
scaled row's amax lies in ``(224, 448]``, that error is below ``2**-10 / 224 < 2**-17`` of the row's amax.
So with ``e(x) = u |x| + 2**-17 amax`` per element::

    |<q^, k^> - <q, k>| <= E = sum_d e(q_d) |k_d| + |q_d| e(k_d) + e(q_d) e(k_d)
    |silu(alpha s^ + r) - silu(alpha s + r)| <= 1.1 alpha E            (|silu'| <= 1.0998)

and the kernel then rounds ``silu`` and the output to bf16 (``2**-8`` each, as the bf16 kernel does), so::

    |out^_i - out_i| <= (1/N) sum_j mask (1.1 alpha E_ij (1 + 2**-8) + 2**-8 |silu(z_ij)|) |v_j|
                        + 2**-8 |out_i| + 1e-6

elementwise (:func:`e4m3_bound`); it is a worst case (errors of one sign in every term), so the
measured error sits well under it. Separately, the kernel fed its own e4m3 inputs must match the
reference fed their dequantized values within the bf16 kernel's tolerance: that checks the scales'
arithmetic, which the loose bound alone might not catch.

Runs in Triton's interpreter, which runs the fp8 ``tl.dot`` (it converts e4m3 to fp16 and multiplies in
fp32; the kernel's ``dot`` helper converts to fp32 first, the same values): covered are the loads of e4m3
bytes, the scales, the mask and bias paths and the dot's exact products. Not covered: the GPU's fp8
wgmma accumulator, which keeps fewer bits than fp32 (``benchmarks/attention_fp8.py`` checks the H200
output against float64), and the compiled code (test_compile.py compiles it for sm_90).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gem_kernels.attention import TritonJaggedAttention
from gem_kernels.attention_fp8 import quantize_qk
from gem_kernels.attention_triton import query_major
from gem_kernels.hstu_gap_triton import hstu_gap_triton
from gem_kernels.reference import attention_mask, jagged_attention_reference
from gem_kernels.testing import offsets_from_lengths, random_qkv, relative_error
from gem_model.api import AttentionExtras, relative_bias_matrix, time_bias_matrix

pytestmark = pytest.mark.usefixtures("poison")

U = 2.0**-4
SUBNORMAL = 2.0**-17
BF16 = 2.0**-8
SILU_SLOPE = 1.1


def e4m3_emulated(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[L, H, D]`` through e4m3 with one power-of-two scale per (token, head), the rule of
    gem-precision's row quantizer (whose bits the root test tests/test_attention_fp8_bits.py holds the
    kernel to), back in float64."""
    amax = x.double().abs().amax(-1, keepdim=True)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa 2**exponent, mantissa in [0.5, 1)
    s = (8 - (exponent - 1) - (2 * mantissa > 1.75).int()).clamp(-126, 126)
    s = torch.where(amax > 0, s, 126).double()
    return (x.double() * 2**s).float().to(torch.float8_e4m3fn).double() * 2**-s


def e4m3_bound(q, k, v, offsets, *, max_seq_len, alpha, extras: AttentionExtras) -> torch.Tensor:
    """The elementwise bound of the module docstring, float64 ``[L, H, Dv]``."""
    q, k, v = q.double(), k.double(), v.double()
    lengths = (offsets[1:] - offsets[:-1]).tolist()
    out = torch.zeros(v.shape, dtype=torch.float64)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        rows = slice(int(offsets[b]), int(offsets[b]) + n)
        targets = None if extras.num_targets is None else extras.num_targets[b : b + 1]
        mask = attention_mask(torch.tensor([n]), targets, extras.max_attn_len, n)[0]
        bias = torch.zeros(n, n, dtype=torch.float64)
        if extras.position_bias is not None:
            bias += relative_bias_matrix(extras.position_bias.double(), n, max_seq_len)
        if extras.time_bias is not None:
            bias += time_bias_matrix(extras.time_bias.double(), extras.query_timestamps[rows], extras.timestamps[rows])
        for h in range(q.shape[1]):
            qh, kh, vh = q[rows, h], k[rows, h], v[rows, h]
            eq = U * qh.abs() + SUBNORMAL * qh.abs().amax(-1, keepdim=True)
            ek = U * kh.abs() + SUBNORMAL * kh.abs().amax(-1, keepdim=True)
            e = eq @ kh.abs().T + qh.abs() @ ek.T + eq @ ek.T
            z = alpha * qh @ kh.T + bias
            term = SILU_SLOPE * alpha * e * (1 + BF16) + BF16 * F.silu(z).abs()
            exact = torch.where(mask, F.silu(z), 0.0) @ vh / max_seq_len
            out[rows, h] = (torch.where(mask, term, 0.0) @ vh.abs()) / max_seq_len * (1 + BF16) + BF16 * exact.abs()
    return out + 1e-6


def random_case(gen: torch.Generator, lengths: list[int], *, biases: bool, window: bool, heads: int = 2, dim: int = 32):
    """bf16 inputs; ``window``: a random ``max_attn_len`` (else none: tiles with key blocks in full view)."""
    offsets = offsets_from_lengths(lengths)
    rows = int(offsets[-1])
    max_seq_len = max(lengths) + 3
    q, k, v = random_qkv(rows, heads, dim, dim, torch.bfloat16, gen)
    q = q * 4  # per-token scales differ from one token to the next
    targets = torch.minimum(torch.randint(1, 4, (len(lengths),), generator=gen), torch.tensor(lengths))
    max_attn_len = int(torch.randint(2, 12, (1,), generator=gen)) if window else 0
    tables = {}
    if biases:
        times = torch.cumsum(torch.randint(0, 5000, (rows,), generator=gen), 0)
        tables = dict(position_bias=0.5 * torch.randn(2 * max_seq_len - 1, generator=gen),
                      time_bias=0.5 * torch.randn(24, generator=gen), timestamps=times,
                      query_timestamps=times + torch.randint(0, 100, (rows,), generator=gen))  # fmt: skip
    extras = AttentionExtras(num_targets=targets, max_attn_len=max_attn_len, **tables)
    return q, k, v, offsets, dict(max_seq_len=max_seq_len, alpha=1.0 / math.sqrt(dim), extras=extras)


@pytest.mark.parametrize(("biases", "window"), [(False, False), (True, True)], ids=["no_bias", "biases_window"])
def test_fp8_forward_within_the_e4m3_bound(gen: torch.Generator, biases: bool, window: bool) -> None:
    q, k, v, offsets, options = random_case(gen, [13, 0, 41, 6], biases=biases, window=window)
    kernel = TritonJaggedAttention(TritonJaggedAttention.Config(fp8_forward=True))
    with torch.no_grad():
        got = kernel(q, k, v, offsets, **options)
        plain = TritonJaggedAttention()(q, k, v, offsets, **options)
    want = jagged_attention_reference(q.double(), k.double(), v.double(), offsets, **options)
    excess = (got.double() - want).abs() - e4m3_bound(q, k, v, offsets, **options)
    assert torch.isfinite(got).all() and excess.max() <= 0, f"over the bound by {excess.max():.2e}"
    assert not torch.equal(got, plain)  # the fp8 mode ran
    # the kernel's arithmetic on its own e4m3 inputs: the bf16 kernel's tolerance
    emulated = jagged_attention_reference(e4m3_emulated(q), e4m3_emulated(k), v.double(), offsets, **options)
    assert relative_error(got, emulated) < 1e-2, relative_error(got, emulated)


def test_fp8_query_major_writes_every_output_row(gen: torch.Generator) -> None:
    """Into a NaN-filled strided ``out``, with tiles that cross sequence ends and a key-scale load per block."""
    q, k, v, offsets, options = random_case(gen, [1, 50, 0, 9], biases=False, window=False)
    extras = options.pop("extras")
    q8, k8, scales = quantize_qk(q, k)
    assert torch.equal(q8.double() * scales[..., :1].double(), e4m3_emulated(q))
    assert torch.equal(k8.double() * scales[..., 1:].double(), e4m3_emulated(k))
    buffer = torch.full((q.shape[0], 2, 40), float("nan"), dtype=torch.bfloat16)
    out = buffer[:, :, 4:36]
    query_major(q8, k8, v, None, offsets, extras.num_targets, max_attn_len=extras.max_attn_len, blocks=(16, 32),
                out=out, fp8_scales=scales, **options)  # fmt: skip
    emulated = jagged_attention_reference(e4m3_emulated(q), e4m3_emulated(k), v.double(), offsets, extras=extras,
                                          **options)  # fmt: skip
    assert relative_error(out, emulated) < 1e-2
    assert buffer[:, :, :4].isnan().all() and buffer[:, :, 36:].isnan().all()


def test_fp8_forward_keeps_the_bf16_backward(gen: torch.Generator) -> None:
    """The backward reads the saved bf16 q, k, v: for one output gradient, the fp8 forward's gradients are
    the bf16 forward's, bit for bit (the interpreter runs programs in order)."""
    q, k, v, offsets, options = random_case(gen, [11, 5], biases=True, window=True)
    grad_out = torch.randn(v.shape, generator=gen).bfloat16()
    grads = {}
    for fp8 in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        kernel = TritonJaggedAttention(TritonJaggedAttention.Config(fp8_forward=fp8, dq="separate"))
        grads[fp8] = torch.autograd.grad(kernel(*leaves, offsets, **options), leaves, grad_out)
    for name, plain, fp8 in zip("qkv", grads[False], grads[True], strict=True):
        assert torch.equal(plain, fp8), f"d{name}"


def test_fused_gap_quantizes_in_its_silu_pass(gen: torch.Generator) -> None:
    """The gap with ``fp8_forward``: its output is the composed ops' whose attention reads e4m3 q, k (of the
    bf16 ``silu(pre)`` it writes), and its gradients those of the composed ops whose attention has the
    fp8 forward's value and the exact attention's gradient."""
    heads, dim, eps = 2, 16, 1e-6
    lengths = [7, 0, 12]
    offsets = offsets_from_lengths(lengths)
    n, hv = int(offsets[-1]), heads * dim
    pre = (torch.randn(n, 4 * hv, generator=gen) * 2).bfloat16()
    weight, bias = 1 + 0.1 * torch.randn(hv, generator=gen), 0.1 * torch.randn(hv, generator=gen)
    dy = torch.randn(n, hv, generator=gen).bfloat16()
    extras = AttentionExtras(num_targets=torch.tensor([2, 0, 1]), max_attn_len=5)
    options = dict(max_seq_len=max(lengths) + 2, alpha=1 / math.sqrt(dim))
    leaves = [t.clone().requires_grad_() for t in (pre, weight, bias)]
    y, _ = hstu_gap_triton(*leaves, offsets, num_heads=heads, attention_dim=dim, value_dim=dim, eps=eps,
                           extras=extras, fp8_forward=True, **options)  # fmt: skip
    got = torch.autograd.grad(y, leaves, dy)

    exact = [t.detach().double().requires_grad_() for t in (pre, weight, bias)]
    u, v, q, k = (x.reshape(n, -1, dim) for x in torch.split(F.silu(exact[0]), hv, dim=-1))
    attn = jagged_attention_reference(q, k, v, offsets, extras=extras, **options)
    written = F.silu(pre.float()).bfloat16()[:, 2 * hv:].reshape(n, 2 * heads, dim)  # what the silu pass writes
    fp8_value = jagged_attention_reference(e4m3_emulated(written[:, :heads]), e4m3_emulated(written[:, heads:]), v,
                                           offsets, extras=extras, **options)  # fmt: skip
    attn = attn + (fp8_value - attn).detach()
    want_y = F.layer_norm(attn.reshape(n, hv), (hv,), exact[1], exact[2], eps) * u.reshape(n, hv)
    want = torch.autograd.grad(want_y, exact, dy.double())
    assert relative_error(y, want_y) < 2e-2, relative_error(y, want_y)  # test_hstu_gap's bf16 tolerance
    for name, g, w in zip(("d_pre", "d_weight", "d_bias"), got, want, strict=True):
        assert relative_error(g, w) < 2e-2, f"{name}: {relative_error(g, w):.2e}"


def test_fp8_forward_under_the_e4m3_saved_format_reads_the_same_e4m3_q_k(gen: torch.Generator) -> None:
    """The saved format's silu pass writes ``post`` as the plain one does, and one more pass quantizes its
    ``q, k``: the output is bit for bit the fp8 forward's without the saved format; the gradients are the
    saved format's (they read ``pre`` from its e4m3 rows), within its tolerance of the plain ones: 10 %
    for ``d_pre``, 15 % for the norm-gate's parameters. Their gradients sum over every row, and e4m3's
    3 mantissa bits leave ~5 % (median over seeds) with a tail near 10 % on a few dozen rows; on the big
    config the largest parameter gradient of the blocks is 8.1 % off (``fp8_saved_block.py``,
    2026-12-04). Seed 396534463 gave 10.6 % for ``d_weight`` on 19 rows."""
    heads, dim = 2, 16
    offsets = offsets_from_lengths([31, 0, 45])
    n, hv = int(offsets[-1]), heads * dim
    pre = (torch.randn(n, 4 * hv, generator=gen) * 2).bfloat16()
    weight, bias = 1 + 0.1 * torch.randn(hv, generator=gen), 0.1 * torch.randn(hv, generator=gen)
    dy = torch.randn(n, hv, generator=gen).bfloat16()
    extras = AttentionExtras(num_targets=torch.tensor([2, 0, 1]), max_attn_len=5)
    results = []
    for saved_format in (None, "e4m3_row"):
        leaves = [t.clone().requires_grad_() for t in (pre, weight, bias)]
        y, _ = hstu_gap_triton(*leaves, offsets, num_heads=heads, attention_dim=dim, value_dim=dim, eps=1e-6,
                               extras=extras, max_seq_len=46, alpha=1 / math.sqrt(dim), fp8_forward=True,
                               saved_format=saved_format)  # fmt: skip
        results.append((y, torch.autograd.grad(y, leaves, dy)))
    (y_plain, g_plain), (y_saved, g_saved) = results
    assert torch.equal(y_saved, y_plain)
    for name, a, b, tolerance in zip(("d_pre", "d_weight", "d_bias"), g_saved, g_plain, (0.1, 0.15, 0.15), strict=True):
        assert torch.isfinite(a).all() and relative_error(a, b) < tolerance, f"{name}: {relative_error(a, b):.2e}"


def test_fp8_forward_is_off_by_default_and_refuses_what_it_cannot_do(gen: torch.Generator) -> None:
    assert TritonJaggedAttention.Config().fp8_forward is False
    q, k, v, offsets, options = random_case(gen, [4, 3], biases=False, window=False)
    kernel = TritonJaggedAttention(TritonJaggedAttention.Config(fp8_forward=True))
    with pytest.raises(ValueError, match="fp8_forward needs bfloat16 or float16 activations.*got torch.float32"):
        kernel(q.float(), k.float(), v.float(), offsets, **options)
    with pytest.raises(ValueError, match="fp8_scales is for the forward of float8_e4m3fn q, k"):
        query_major(q, k, v, None, offsets, None, max_seq_len=8, alpha=1.0, max_attn_len=0,
                    fp8_scales=torch.ones(q.shape[0], 2, 2))  # fmt: skip
