"""The fp8 forward of the jagged HSTU attention: ``q k^T`` in e4m3, everything after it as before
(imports triton).

What it computes
----------------
With ``q8[i, h] = e4m3(q[i, h] * 2**a)`` and ``k8[j, h] = e4m3(k[j, h] * 2**b)`` (one power-of-two scale
per token and head), the query-major kernel (:mod:`gem_kernels.attention_triton`, ``FP8``) computes::

    s[i, j] = <q8[i], k8[j]> * 2**-a(i) * 2**-b(j)          # fp8 MMA, fp32 accumulator, scales in fp32
    out[i]  = sum_j mask(i, j) * silu(alpha * s[i, j] + r(i, j)) / N * v[j]   # as the bf16 kernel

Only the scores change: the silu, the mask, the biases, the cast of ``silu(s)`` to the activation dtype
and the ``p v`` MMA are the bf16 kernel's.

Scales: one per (token, head)
-----------------------------
The scale rule is gem-precision's row rule (``gem_precision.fp8_reference``; the numbers are
``gem_model.api.RowQuantization``'s) applied to the ``D`` values of one head of one token: ``2**s`` with
``s`` the largest integer such that ``amax * 2**s <= 448``. Why this granularity:

* one scale per head of the batch needs the head's amax over every token before the first byte can
  be cast: a second pass over the activation (or an atomic amax, then a cast pass), which is what makes
  ``fp8_rowwise``'s separate quantization cost what its GEMMs save (issue 30);
* one scale per block of rows (FlashAttention-3's) ties the producer's tile to the attention's
  ``BLOCK_M`` / ``BLOCK_N``, which are tuned per call;
* per token and head, the program that holds a token's head has its amax in registers, so the
  producer writes the e4m3 bytes in the pass that reads the values. In the kernel it costs a
  ``[BLOCK_N]`` float32 load per key block (4 bytes beside ``Dqk`` bytes of ``k8``: 3 % at 128) and one
  multiply per score; the queries' factors fold into ``alpha`` (a ``[BLOCK_M, 1]`` column instead of a
  scalar). Power-of-two factors are exact in fp32: the only rounding is e4m3's. It is also the finest
  granularity, so a token with large values does not cost its neighbours their bits.

Both factors of a tile travel in one float32 ``[L, H, 2]`` tensor (q's at 0, k's at 1), which the
kernel reads through its ``DO`` pointer (unused by the forward): the kernel's signature, and so the
default path's compiled code, stay what they were.

``p v`` stays in the activation dtype
-------------------------------------
The alternative, ``p`` in e4m3 per query row of the tile and ``v`` per head:

* ``p = silu(s) / N`` is not bounded as softmax's probabilities are (silu grows linearly), so each tile
  needs its own scale per row: a row max across the tile's threads (shuffles) per key block, and the
  product then has to be rescaled before it joins the accumulator, so the MMA cannot accumulate into
  ``acc`` itself: a second ``[BLOCK_M, Dv]`` fp32 register tile. The forward already sits at 250-255
  registers at its 128-row tiles (``compile_report``), so that tile spills.
* Hopper's fp8 wgmma takes both operands K-major. For ``p v`` the reduction runs over keys, and ``v``
  ``[BLOCK_N, Dv]`` is stored with ``Dv`` contiguous: MN-major. Triton then transposes ``v`` through
  shared memory per tile (or the producer writes ``v^T`` per sequence, which the jagged layout makes
  a layout of its own).

``q k^T`` needs neither: ``q`` ``[BLOCK_M, Dqk]`` and ``k`` ``[BLOCK_N, Dqk]`` are both K-major with
``Dqk`` contiguous, and the scores are scaled in fp32 before anything else reads them. So the simpler
correct one first: the fp8 MMA for ``q k^T`` (half the bytes of ``k`` read per tile, the fp8 tensor
core rate for one of the two MMAs), bf16 for ``p v``. Measured, it does not pay, so it stays an option,
off by default:

* on the H200 (2026-12-02, ``benchmarks/attention_fp8.py``) it took 0.92-0.97x the bf16 forward's time;
* on the H100 at the 700 W cap (2026-12-06, ``benchmarks/kernel_energy.py``, the big config's
  lengths) it took 1.707 J and 2.474 ms a call against the bf16 forward's 1.493 J and 2.142 ms. That is
  1.14x the energy, though it ran at 1,785 MHz against 1,440. The fp8 builds take 255 registers with
  8-16 bytes of spills at the ``64 x 64`` tiles (``compile_report --fp8``); the bf16 builds take 255
  with no spills.

Accumulation: ``tl.dot`` of two e4m3 tiles with a float32 result. Triton's default on sm_90
(``max_num_imprecise_acc`` unset) keeps the whole ``Dqk`` chain in the wgmma accumulator, whose
additions keep fewer bits than fp32's; at ``Dqk <= 256`` that error is far below e4m3's rounding of
the inputs (the products themselves are exact).

Where the bytes come from
-------------------------
In the fused HSTU gap (:mod:`gem_kernels.hstu_gap_triton`), the pass that writes ``post = silu(v, q,
k)`` writes the e4m3 ``q``, ``k`` and their scales too (:func:`silu_quantize_qk`): it quantizes the
bf16 values it has just written, so the bytes are gem-precision's quantization of the ``q`` and ``k``
that the backward reads. Outside the gap (plain ``jagged_attention_triton``) the inputs come from
somewhere else, so :func:`quantize_qk` is one Triton pass over ``q`` and ``k`` (a read of each and a
write of half its bytes): acceptable there, and the reason the gap's path is the one to use.

Numerics and training
---------------------
Each e4m3 value carries 3 mantissa bits: round to nearest is within ``2**-4`` of the value (relative;
below e4m3's smallest normal, within ``2**-10`` of the scaled row's amax over ``[224, 448]``). The score
``s`` then differs from the bf16 kernel's by up to ``~2 * 2**-4 * sum_d |q_d k_d|`` and the output by the
same through ``silu`` (slope at most 1.1). The backward is unchanged: it reads the saved bf16 ``q``,
``k``, ``v`` and recomputes the scores in bf16. So the attention's gradients are those of the bf16
attention at the same inputs, for the output gradient it is handed; everything after the attention
(the norm-gate, the loss) sees the fp8 output and is differentiated at it. In graph terms: the
attention is ``bf16(q, k, v) + (fp8(q, k, v) - bf16(q, k, v)).detach()``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard, dim_block
from gem_kernels.quantized_rows_triton import NAN_BYTE, abs_bits, e4m3_bits, pow2_scale

E4M3 = torch.float8_e4m3fn
ROWS = 4 if INTERPRET else 32
"""Tokens per program: a program quantizes ``ROWS`` tokens of one head (``ROWS x D`` values)."""


@triton.jit
def _quantize_heads(X, POST, DATA, SCALES, stride_xm, stride_xg, stride_pm, stride_pg, stride_dm, num_rows,
                    num_heads, which0, D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr,
                    SILU: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """Head group ``g = program_id(1)`` of ``ROWS`` tokens: ``x = X[rows, g]`` (``SILU``: ``x = silu(X)`` in
    ``POST``'s dtype, written to ``POST[rows, g]``), its e4m3 bytes to ``DATA[rows, g]`` and their
    dequantization factors to ``SCALES[rows, g % num_heads, which0 + g // num_heads]`` (``[L, H, 2]``)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    group = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    rows_ok = rows < num_rows
    inside = rows_ok[:, None] & (cols < D)[None, :]
    x = tl.load(X + rows[:, None] * stride_xm + group * stride_xg + cols[None, :], mask=inside, other=0.0)
    if SILU:  # the same ops as hstu_gap_triton._silu_columns: the same bits of post
        z = x.to(tl.float32)
        x = cast(z * tl.sigmoid(z), POST.dtype.element_ty, INTERP)
        tl.store(POST + rows[:, None] * stride_pm + group * stride_pg + cols[None, :], x, mask=inside)
    y = x.to(tl.float32)
    bits = tl.where(inside, abs_bits(y), 0)
    scale, scale_inv, nonfinite = pow2_scale(tl.max(bits, 1))
    q = tl.where(nonfinite[:, None], NAN_BYTE, e4m3_bits(y * scale[:, None]))
    tl.store(DATA + rows[:, None] * stride_dm + group * D + cols[None, :], q.to(tl.uint8), mask=inside)
    head = group % num_heads
    which = which0 + group // num_heads
    tl.store(SCALES + rows * (2 * num_heads) + head * 2 + which, scale_inv, mask=rows_ok)


def _launch(x: torch.Tensor, post: torch.Tensor | None, data: torch.Tensor, scales: torch.Tensor, which0: int) -> None:
    """``x``, ``post``: ``[L, G, D]`` views (unit last stride); ``data``: contiguous ``[L, G, D]`` e4m3."""
    num_rows, groups, dim = x.shape
    if num_rows == 0:
        return
    post_ = post if post is not None else x
    with device_guard(x.device):
        _quantize_heads[(triton.cdiv(num_rows, ROWS), groups)](
            x, post_, data.view(torch.uint8), scales, x.stride(0), x.stride(1), post_.stride(0), post_.stride(1),
            data.stride(0), num_rows, scales.shape[1], which0, D=dim, BLOCK_D=dim_block(dim), ROWS=ROWS,
            SILU=post is not None, INTERP=INTERPRET, num_warps=4,
        )  # fmt: skip


def quantize_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q``, ``k`` ``[L, H, D]`` (unit last stride) in e4m3 per token and head: ``(q8, k8, scales)``, the
    factors float32 ``[L, H, 2]`` with ``q ~= q8 * scales[..., 0, None]`` and ``k ~= k8 * scales[..., 1, None]``.
    One Triton pass over each (for callers whose q and k no kernel of ours produced)."""
    num_rows, heads, _ = q.shape
    scales = torch.empty((num_rows, heads, 2), dtype=torch.float32, device=q.device)
    q8, k8 = torch.empty(q.shape, dtype=E4M3, device=q.device), torch.empty(k.shape, dtype=E4M3, device=k.device)
    _launch(q, None, q8, scales, 0)
    _launch(k, None, k8, scales, 1)
    return q8, k8, scales


def silu_quantize_qk(pre_qk: torch.Tensor, post_qk: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        torch.Tensor]:  # fmt: skip
    """``post_qk[:] = silu(pre_qk)`` for the ``q`` then ``k`` columns of the fused gap (``[L, 2 H D]`` each,
    unit column stride), and in the same pass their e4m3 copies: ``(q8, k8, scales)`` as
    :func:`quantize_qk` returns them, of the values written to ``post_qk``. ``q8``, ``k8`` are views of one
    ``[L, 2 H, D]`` buffer."""
    num_rows, width = pre_qk.shape
    dim = width // (2 * heads)
    data = torch.empty((num_rows, 2 * heads, dim), dtype=E4M3, device=pre_qk.device)
    scales = torch.empty((num_rows, heads, 2), dtype=torch.float32, device=pre_qk.device)
    _launch(pre_qk.view(num_rows, 2 * heads, dim), post_qk.view(num_rows, 2 * heads, dim), data, scales, 0)
    return data[:, :heads], data[:, heads:], scales


def check_fp8_inputs(v: torch.Tensor) -> None:
    """The fp8 forward casts ``silu(s)`` to ``v``'s dtype for its second MMA: a 16-bit float."""
    if v.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            "kernels.jagged_attention.options.fp8_forward needs bfloat16 or float16 activations (the precision "
            f"scheme's activation dtype), got {v.dtype}; set fp8_forward=false or use a 16-bit scheme"
        )
