"""The fused gap keeping its pre-activation in e4m3 rows (``saved_format="e4m3_row"``,
gem_kernels.hstu_gap_saved), in Triton's interpreter on fresh random data:

- the forward is that of the plain gap, bit for bit, and what it keeps is the e4m3 rows of ``pre`` and of
  the attention output and their scales (no ``silu(v, q, k)``, no attention output as computed);
- the gradients are those of the composed float64 ops whose backward sees the e4m3-rounded
  pre-activation (the exact check of every expansion), and lie within a stated bound of the plain
  gap's;
- the rows follow the row rule (largest power-of-two scale, zeros, NaN and infinity); the root test
  ``tests/test_fused_saved.py`` checks the bytes against gem-precision's reference quantizer.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from gem_kernels import hstu_gap_triton as hstu_gap_triton_module
from gem_kernels.hstu_gap_saved import expand_rows, silu_quantize_rows
from gem_kernels.hstu_gap_triton import hstu_gap_triton, silu_columns
from gem_kernels.norm_gate_triton import NormGateFunction, norm_gate_backward
from gem_kernels.quantized_rows_triton import RowsOut, dequantize_rows
from gem_kernels.reference import jagged_attention_reference
from gem_kernels.testing import offsets_from_lengths, relative_error
from gem_model.api import E4M3_ROW, AttentionExtras, RowQuantization

pytestmark = pytest.mark.usefixtures("poison")

HEADS, DQK, DV = 2, 16, 16
HV, HQ = HEADS * DV, HEADS * DQK
WIDTH = 2 * HV + 2 * HQ
EPS = 1e-6
# e4m3 keeps 3 mantissa bits: each element of the rounded pre-activation is within 2**-4 of it,
# relatively (half a step of 2**-3; in absolute terms below e4m3's smallest normal). A gradient of v, q or k multiplies silu' at a rounded value by
# sums over keys of products of two rounded values, whose terms cancel: over 50 seeds the relative
# error of d_pre against the plain gap was 4-18 % (typically 6 %), of the gate's weight and bias 2-5 %.
# With the attention output in e4m3 rows too (seeds 0-29, float32, separate dq): d_pre 4.7-8.4 %, the
# gate's weight 2.5-9.0 %, its bias 1.9-4.7 %.
# The bound is 0.3; the exact agreement is checked against the float64 composition below.
AGAINST_PLAIN = 0.3


def dequantized(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    return data.double() * scale_inv.double()[:, None]


def within_e4m3_rounding(rounded: torch.Tensor, x: torch.Tensor, scale_inv: torch.Tensor) -> bool:
    """Half a step of e4m3 from ``x``: 2**-4 relative in the normal range, half the subnormal spacing
    (2**-9, scaled) below it."""
    x = x.double()
    bound = torch.maximum(2**-4 * x.abs(), 2**-10 * scale_inv.double()[:, None])
    return bool(((rounded - x).abs() <= bound).all())


def gap(pre, weight, bias, offsets, extras, dq_mode, saved_format):
    y, rows = hstu_gap_triton(pre, weight, bias, offsets, num_heads=HEADS, attention_dim=DQK, value_dim=DV,
                              max_seq_len=12, alpha=1 / math.sqrt(DQK), eps=EPS, extras=extras, dq_mode=dq_mode,
                              saved_format=saved_format)  # fmt: skip
    assert rows is None  # no quantized rows asked for
    return y


def rounded_reference(pre, pre_hat, attn_hat, weight, bias, offsets, extras):
    """The float64 gap whose backward sees ``pre_hat`` and the attention output ``attn_hat`` (both as kept
    in e4m3 rows), with the layer norm's mean and 1/std from the forward's exact attention output: the
    gradients reach ``pre_hat`` through silu, attention and the gate evaluated there, and the layer
    norm's backward is its Jacobian at ``(attn_hat - mean) * rstd``."""
    n = pre.shape[0]

    def attention(p):
        _, v, q, k = torch.split(F.silu(p), [HV, HV, HQ, HQ], dim=-1)
        return jagged_attention_reference(q.reshape(n, HEADS, DQK), k.reshape(n, HEADS, DQK), v.reshape(n, HEADS, DV),
                                          offsets, max_seq_len=12, alpha=1 / math.sqrt(DQK), extras=extras).reshape(n, HV)  # fmt: skip

    exact = attention(pre).detach()
    mean = exact.mean(-1, keepdim=True)
    rstd = (exact.var(-1, unbiased=False, keepdim=True) + EPS).rsqrt()
    through_hat = attention(pre_hat)
    a = attn_hat + through_hat - through_hat.detach()
    xhat = (attn_hat - mean) * rstd
    # its gradient in a: rstd (g - mean(g) - xhat mean(g xhat)), the layer norm's Jacobian at xhat
    z = rstd * (a - a.mean(-1, keepdim=True)) - rstd * xhat * (xhat * a).mean(-1, keepdim=True)
    return ((xhat + z - z.detach()) * weight + bias) * F.silu(pre_hat[:, :HV])


@pytest.mark.parametrize(("dtype", "dq_mode"), [(torch.float32, "separate"), (torch.float32, "atomic"),
                                              (torch.bfloat16, "atomic")])  # fmt: skip
def test_compressed_gap_keeps_e4m3_rows_and_its_gradients_follow_them(gen, dtype, dq_mode):
    lengths = [5, 0, 9, 2]
    offsets = offsets_from_lengths(lengths)
    n = int(offsets[-1])
    pre = (torch.randn(n, WIDTH, generator=gen) * 2).to(dtype)
    weight = 1 + 0.1 * torch.randn(HV, generator=gen)
    bias = 0.1 * torch.randn(HV, generator=gen)
    dy = torch.randn(n, HV, generator=gen).to(dtype)
    extras = AttentionExtras(num_targets=torch.tensor([1, 0, 2, 1]))

    results = {}
    for fmt in (None, E4M3_ROW):
        leaves = [t.detach().clone().requires_grad_() for t in (pre, weight, bias)]
        y = gap(*leaves, offsets, extras, dq_mode, fmt)
        kept = y.grad_fn.saved_tensors
        results[fmt] = (y, torch.autograd.grad(y, leaves, dy), kept)
    (y_plain, g_plain, kept_plain), (y_fp8, g_fp8, kept_fp8) = results[None], results[E4M3_ROW]

    assert torch.equal(y_fp8, y_plain)  # the forward computes from the exact pre-activation
    data, scale_inv, attn_data, attn_scale_inv = kept_fp8[:4]
    for rows, width in ((data, WIDTH), (attn_data, HV)):
        assert rows.dtype == torch.float8_e4m3fn and rows.shape == (n, width)
    for scales in (scale_inv, attn_scale_inv):
        assert scales.dtype == torch.float32 and scales.shape == (n,)
    attn = kept_plain[2].view(n, HV)  # the attention output as the plain gap keeps it
    assert not any(t.shape == (n, WIDTH - HV) for t in kept_fp8 if t is not None)  # no silu(v, q, k)
    assert not any(t.shape in ((n, HEADS, DV), (n, HV)) and t.dtype == dtype for t in kept_fp8 if t is not None)  # nor attn
    pre_hat, attn_hat = dequantized(data, scale_inv), dequantized(attn_data, attn_scale_inv)
    assert within_e4m3_rounding(pre_hat, pre, scale_inv)
    assert within_e4m3_rounding(attn_hat, attn, attn_scale_inv)

    exact = [pre.double().requires_grad_(), weight.double().requires_grad_(), bias.double().requires_grad_()]
    hat = pre_hat.clone().requires_grad_()
    want_y = rounded_reference(exact[0].detach(), hat, attn_hat, exact[1], exact[2], offsets, extras)
    want = torch.autograd.grad(want_y, [hat, exact[1], exact[2]], dy.double())
    # bf16: the kernels' own rounding (post, attention and d_pre in bf16) is as large as e4m3's here:
    # the plain bf16 gap's d_pre was 3.7 % from its float64 reference on one seed of 30
    tolerance = 1e-5 if dtype == torch.float32 else 0.1
    for name, got, w, plain in zip(("d_pre", "d_weight", "d_bias"), g_fp8, want, g_plain):
        assert relative_error(got, w) < tolerance, f"{name}: {relative_error(got, w):.2e} against the rounded reference"
        assert relative_error(got, plain) < AGAINST_PLAIN, f"{name}: {relative_error(got, plain):.2e} against plain"


def test_no_grad_keeps_nothing_compressed(gen):
    pre = torch.randn(6, WIDTH, generator=gen)
    offsets = offsets_from_lengths([6])
    with torch.no_grad():
        y = gap(pre, torch.ones(HV), torch.zeros(HV), offsets, AttentionExtras(), "auto", E4M3_ROW)
    assert torch.equal(y, gap(pre, torch.ones(HV), torch.zeros(HV), offsets, AttentionExtras(), "auto", None))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # silu of the infinity
@pytest.mark.parametrize("chunk", [None, 32], ids=["whole rows", "rows in chunks"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_quantize_rows_follows_the_row_rule(gen, chunk, dtype):
    pre = (torch.randn(7, 60, generator=gen) * torch.logspace(-3, 3, 7)[:, None]).to(dtype)
    pre[2] = 0.0
    pre[4, 5], pre[5, 40] = float("inf"), float("nan")
    plain = silu_columns(pre[:, 20:], torch.empty(7, 40, dtype=dtype))
    post = torch.empty(7, 40, dtype=dtype)
    data, scale_inv = silu_quantize_rows(pre, post, 20, chunk=chunk)
    torch.testing.assert_close(post, plain, rtol=0, atol=0, equal_nan=True)  # bit for bit the plain silu pass
    finite = [0, 1, 3, 6]
    amax = pre[finite].double().abs().amax(1)
    scale = 1 / scale_inv[finite].double()
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())  # powers of two
    assert ((amax * scale <= 448) & (amax * scale * 2 > 448)).all()  # the largest such power
    assert within_e4m3_rounding(dequantized(data, scale_inv)[finite], pre[finite], scale_inv[finite])
    assert (data[2].view(torch.uint8) == 0).all() and scale_inv[2] == 2.0**-126
    for bad in (4, 5):  # a non-finite row is NaN throughout, as the reference writes it
        assert (data[bad].view(torch.uint8) == 0x7F).all() and scale_inv[bad].isnan()


# (u columns, width): with the interpreter's 64-column expand tiles, (20, 70) has a tile across the u/post
# boundary and one of post only; (64, 150) a tile of u only and two of post only
@pytest.mark.parametrize("hv, width", [(20, 70), (64, 150)])
def test_expand_rows_and_the_e4m3_silu_gradient(gen, hv, width):
    pre = torch.randn(9, width, generator=gen) * 3
    data, scale_inv = silu_quantize_rows(pre, torch.empty(9, width - hv), hv)
    pre_hat = dequantized(data, scale_inv).float()
    for dtype in (torch.float32, torch.bfloat16):
        u, post = expand_rows(data, scale_inv, hv, dtype)
        assert torch.equal(u, pre_hat[:, :hv].to(dtype))  # e4m3 values are exact in bf16
        torch.testing.assert_close(post, F.silu(pre_hat[:, hv:]).to(dtype), rtol=1e-6 if dtype == torch.float32 else 1e-2,
                                   atol=1e-6)  # fmt: skip
    g = torch.randn(9, 30, generator=gen)
    z = pre_hat[:, 40:70].clone().requires_grad_()
    (want,) = torch.autograd.grad(F.silu(z), z, g)
    got = silu_columns(data[:, 40:70], torch.empty(9, 30), grad=g, scale_inv=scale_inv)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_gap_refuses_an_unknown_saved_format():
    with pytest.raises(ValueError, match="saved_format must be None or 'e4m3_row', got 'e5m2_row'"):
        gap(torch.zeros(4, WIDTH), torch.ones(HV), torch.zeros(HV), offsets_from_lengths([4]), AttentionExtras(), "auto",
            "e5m2_row")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_gate_keeps_the_e4m3_rows_of_its_input(gen, dtype):
    """The norm-gate forward writing the e4m3 rows of its input ``x`` (``x_rows``; the fused gap keeps
    the attention output so) beside ``y``, and :func:`dequantize_rows` giving their values back exactly."""
    rows, dim = 23, 40  # several row tiles; the last of the interpreter's 64-column tile masked
    x = (torch.randn(rows, dim, generator=gen) * torch.logspace(-2, 2, rows)[:, None]).to(dtype)
    u = torch.randn(rows, dim, generator=gen).to(dtype)
    weight, bias = 1 + 0.1 * torch.randn(dim, generator=gen), 0.1 * torch.randn(dim, generator=gen)
    rows_out = RowsOut.allocate(rows, dim, x.device, RowQuantization())
    kept = (rows_out.data, rows_out.scale_inv)
    y, mean, rstd = NormGateFunction.run_forward(x, u, weight, bias, EPS, silu_gate=True, x_rows=rows_out)
    plain = NormGateFunction.run_forward(x, u, weight, bias, EPS, silu_gate=True)
    for got, want in zip((y, mean, rstd), plain):  # the interpreter sums in one order (a GPU may not: run_forward)
        assert torch.equal(got, want)
    data = kept[0].view(torch.float8_e4m3fn)
    x_hat = dequantized(data, kept[1])
    assert within_e4m3_rounding(x_hat, x, kept[1])
    assert torch.equal(dequantize_rows(data, kept[1], dtype), x_hat.to(dtype))  # e4m3 values are exact in dtype


def test_the_attention_output_kept_as_computed_when_asked(gen, monkeypatch):
    """``SAVED_ATTENTION_E4M3 = False`` (an A/B switch): the gap keeps ``pre``'s rows and the attention
    output as computed, and its gradients still follow the plain gap's within the bound."""
    monkeypatch.setattr(hstu_gap_triton_module, "SAVED_ATTENTION_E4M3", False)
    offsets = offsets_from_lengths([7, 4])
    pre, dy = torch.randn(11, WIDTH, generator=gen) * 2, torch.randn(11, HV, generator=gen)
    weight, bias = 1 + 0.1 * torch.randn(HV, generator=gen), 0.1 * torch.randn(HV, generator=gen)
    results = {}
    for fmt in (None, E4M3_ROW):
        leaves = [t.detach().clone().requires_grad_() for t in (pre, weight, bias)]
        y = gap(*leaves, offsets, AttentionExtras(), "separate", fmt)
        results[fmt] = (y.grad_fn.saved_tensors, torch.autograd.grad(y, leaves, dy))
    (kept_plain, g_plain), (kept_fp8, g_fp8) = results[None], results[E4M3_ROW]
    assert kept_fp8[0].dtype == torch.float8_e4m3fn and torch.equal(kept_fp8[2], kept_plain[2])
    for got, plain in zip(g_fp8, g_plain):
        assert relative_error(got, plain) < AGAINST_PLAIN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_gate_backward_reads_e4m3_rows_as_words(gen, dtype):
    """The norm-gate backward reading ``x`` and ``u`` from e4m3 rows in its loop (16-bit words split into
    bytes; ``u`` as the first columns of wider rows, as the fused gap keeps them) gives, bit for bit, the
    backward of those rows' values as tensors."""
    rows, dim, width = 23, 40, 96  # several row tiles; the interpreter's 64-column tile has 24 masked columns
    x = (torch.randn(rows, dim, generator=gen) * torch.logspace(-2, 2, rows)[:, None]).to(dtype)
    pre = torch.randn(rows, width, generator=gen) * 3
    dy = torch.randn(rows, dim, generator=gen).to(dtype)
    weight, bias = 1 + 0.1 * torch.randn(dim, generator=gen), 0.1 * torch.randn(dim, generator=gen)
    rows_out = RowsOut.allocate(rows, dim, x.device, RowQuantization())
    kept = (rows_out.data, rows_out.scale_inv)
    u_hat_full, pre_scale = silu_quantize_rows(pre, torch.empty(rows, width - dim), dim)
    u_data = u_hat_full[:, :dim]  # a view with the wider rows' stride
    u_hat = dequantized(u_data, pre_scale).to(dtype)
    _, mean, rstd = NormGateFunction.run_forward(x, u_hat, weight, bias, EPS, silu_gate=True, x_rows=rows_out)
    x_data = kept[0].view(torch.float8_e4m3fn)
    x_hat = dequantized(x_data, kept[1]).to(dtype)
    want = norm_gate_backward(dy, x_hat, u_hat, weight, bias, mean, rstd, silu_gate=True)
    got = norm_gate_backward(dy, x_data, u_data, weight, bias, mean, rstd, silu_gate=True, x_scale_inv=kept[1],
                             u_scale_inv=pre_scale)  # fmt: skip
    for name, g, w in zip(("dx", "du", "d_weight", "d_bias"), got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), f"{name}: {relative_error(g, w):.2e} apart"
    with pytest.raises(ValueError, match="even width"):
        norm_gate_backward(dy[:, :39], x_data[:, :39], u_data[:, :39], weight[:39], bias[:39], mean, rstd,
                           x_scale_inv=kept[1], u_scale_inv=pre_scale)  # fmt: skip


@pytest.mark.parametrize("attn_e4m3", [True, False], ids=["attention rows", "attention as computed"])
@pytest.mark.parametrize(("dtype", "dq_mode"), [(torch.float32, "separate"), (torch.bfloat16, "atomic")])
def test_the_gap_reading_its_rows_in_the_norm_gate_loop_gives_the_same_gradients(gen, monkeypatch, dtype, dq_mode,
                                                                                  attn_e4m3):  # fmt: skip
    """``E4M3_ROWS_IN_NORM_GATE``: the norm-gate backward reads ``u`` and the attention output (or, kept as
    computed, only ``u``) from their e4m3 rows, and the expand pass writes only ``silu(v, q, k)``: the
    gradients are those of the way that expands them first, bit for bit."""
    monkeypatch.setattr(hstu_gap_triton_module, "SAVED_ATTENTION_E4M3", attn_e4m3)
    offsets = offsets_from_lengths([5, 0, 9, 2])
    extras = AttentionExtras(num_targets=torch.tensor([1, 0, 2, 1]))
    pre = (torch.randn(16, WIDTH, generator=gen) * 2).to(dtype)
    weight, bias = 1 + 0.1 * torch.randn(HV, generator=gen), 0.1 * torch.randn(HV, generator=gen)
    dy = torch.randn(16, HV, generator=gen).to(dtype)
    grads = {}
    for in_loop in (False, True):
        monkeypatch.setattr(hstu_gap_triton_module, "E4M3_ROWS_IN_NORM_GATE", in_loop)
        leaves = [t.detach().clone().requires_grad_() for t in (pre, weight, bias)]
        y = gap(*leaves, offsets, extras, dq_mode, E4M3_ROW)
        grads[in_loop] = torch.autograd.grad(y, leaves, dy)
    for name, a, b in zip(("d_pre", "d_weight", "d_bias"), grads[True], grads[False]):
        assert torch.equal(a, b), f"{name}: {relative_error(a, b):.2e} apart"
