"""The fused HSTU gap's saved activations in fp8, ``saved_format="e4m3_row"`` (imports triton).

Of what the gap (:mod:`gem_kernels.hstu_gap_triton`) keeps for backward, ``pre`` ``[L, W]`` (``W = H (2 Dv
+ 2 Dqk)``, the uvqk output) and ``post`` (silu of its v, q, k columns, ``[L, W - H Dv]``) are most: 8 and
6 KiB a token at d = 1024 with 8 heads of 128 in bf16, against 2 for the attention output. In this
format the gap keeps instead ``pre`` in e4m3 with one power-of-two float32 scale per row (4 KiB + 4 B a
token), and recomputes ``post`` from it in backward:

* forward, :func:`silu_quantize_rows`: the pass that writes ``post`` reads whole rows of ``pre`` (one
  program holds its rows in registers: a 4096-wide bf16 row is 16 KiB of fp32 across 8 warps, so the
  row's amax comes from the registers already loaded, no second read and no atomics) and writes the
  e4m3 row and its scale beside ``post``. Per token it reads ``2 W`` bytes (the ``u`` columns are new:
  the plain silu pass reads only v, q, k) and writes ``post`` plus ``W + 4``: at the big config
  8 + 6 + 4 KiB against 6 + 6 KiB, +6 KiB a token.
* backward, :func:`expand_rows`: one pass reads the e4m3 rows of the ``v, q, k`` columns and writes
  ``post`` (for the attention backward): 3 KiB in, 6 KiB out a token. The norm-gate backward reads the
  gate ``u`` from its e4m3 columns in its own loop, as 16-bit words
  (``hstu_gap_triton.E4M3_ROWS_IN_NORM_GATE``), and the silu gradient pass reads its ``silu'(pre)`` from
  the e4m3 columns (3 KiB a token instead of 6).

The attention output ``[L, H Dv]`` (2 KiB a token) is kept in e4m3 rows too: the norm-gate's forward
pass, which reads each of its rows whole anyway, writes them beside its output (+1 KiB + 4 B a token,
``NormGateFunction.run_forward``'s ``x_rows``), and the norm-gate backward reads them in its loop as
words. The format frees 11 KiB a token per block between forward and backward (16 -> 5), for about
11 KiB a token of traffic more than the plain gap. With ``E4M3_ROWS_IN_NORM_GATE`` off (the way before
2026-12-04, 19 KiB a token), ``expand_rows`` also writes ``u`` and ``quantized_rows_triton.dequantize_rows``
expands the attention output before the norm-gate backward; read as 1-byte tiles in that kernel's loop,
the rows ran 3.8x slower on the H200 (2.29 against 0.61 ms at 200,000 x 1,024).

The forward outputs are those of the plain gap (``post`` is silu of the exact ``pre``, the norm-gate
reads the exact attention output and, storing its rows as words, sums its rows as without them; with
byte stores ``y`` may differ in its last bit on a GPU); the gradients see ``pre`` and the attention
output rounded to e4m3 (3 mantissa bits: at most 2**-4 relative error per element). The scale
rule and the bytes are gem-precision's row quantizer's (``gem_precision.fp8_reference``, row
granularity; its Triton form is ``gem_precision.fp8_rows_triton._fp8_rows_kernel``): gem-kernels
cannot import gem-precision, so the rule's Triton lines are :mod:`gem_kernels.quantized_rows_triton`'s,
the producers' (one copy in gem-kernels), and a root test checks the bytes against the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard
from gem_kernels.quantized_rows_triton import NAN_BYTE, e4m3_bits, pow2_scale

# constexpr: compiled kernels read only constexpr globals
ROW_CHUNK = 64 if INTERPRET else 4096
"""Columns of a row held in registers at once: wider rows are read twice (the second from L2)."""
EXPAND_TILE = (4, 64) if INTERPRET else (4, 256)
"""(rows, columns) of an expansion program (4 warps). In the sm_90 build a tile of more than 8 values a
thread (16 x 256 is 32) loads its bytes 16 a thread and stores bf16 8 a thread, and converts between the
two layouts through shared memory (13 CTA barriers); 4 x 256, 2 x 256 or 1 x 1024 keep one layout (none).
On the H200 at 207,000 x 4,096 (``benchmarks/pointwise_tiles.py --kernels expand_post``, 2026-12-05): 4 x
256 0.616 ms (3.10 TB/s), 1 x 1024 0.617, 16 x 256 (shipped until then) 0.805: 1.31x."""


@triton.jit
def _store_chunk(z, rows, cols, inside, scale, nonfinite, Q, POST, width, hv, stride_post, INTERP: tl.constexpr):
    bits = tl.where(nonfinite[:, None], NAN_BYTE, e4m3_bits(z * scale[:, None]))
    tl.store(Q + rows[:, None] * width + cols[None, :], bits.to(tl.uint8), mask=inside)
    # post's columns at plain offsets (cols - hv, masked below hv): indices picked by tl.where lose their
    # contiguity, and the stores went 2 bytes at a time (st.global.b16 in the sm_90 PTX; now 16-byte vectors)
    tl.store(POST + rows[:, None] * stride_post + (cols - hv)[None, :], cast(z * tl.sigmoid(z), POST.dtype.element_ty, INTERP),
             mask=inside & (cols >= hv)[None, :])  # fmt: skip


@triton.jit
def _silu_quantize(PRE, POST, Q, SCALE_INV, stride_pre, stride_post, num_rows, width, hv,
                   ROWS: tl.constexpr, BLOCK: tl.constexpr, ONE_CHUNK: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """``POST = silu(PRE[:, hv:])``; ``Q``, ``SCALE_INV``: ``PRE`` in e4m3 rows. Each program owns ``ROWS``
    whole rows."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    rows_ok = rows < num_rows
    cols = tl.arange(0, BLOCK)
    pre_rows = PRE + rows[:, None] * stride_pre
    if ONE_CHUNK:
        inside = rows_ok[:, None] & (cols < width)[None, :]
        z = tl.load(pre_rows + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        amax = tl.max(z.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)  # |z| as bits: NaN above inf
    else:
        amax = tl.zeros([ROWS], dtype=tl.int32)
        for c0 in range(0, width, BLOCK):
            inside = rows_ok[:, None] & (c0 + cols < width)[None, :]
            z = tl.load(pre_rows + c0 + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(z.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
    scale, scale_inv, nonfinite = pow2_scale(amax)
    tl.store(SCALE_INV + rows, scale_inv, mask=rows_ok)
    if ONE_CHUNK:
        _store_chunk(z, rows, cols, inside, scale, nonfinite, Q, POST, width, hv, stride_post, INTERP)
    else:
        for c0 in range(0, width, BLOCK):
            inside = rows_ok[:, None] & (c0 + cols < width)[None, :]
            z = tl.load(pre_rows + c0 + cols[None, :], mask=inside, other=0.0).to(tl.float32)
            _store_chunk(z, rows, c0 + cols, inside, scale, nonfinite, Q, POST, width, hv, stride_post, INTERP)


@triton.jit
def _expand(Q, SCALE_INV, U, POST, stride_u, stride_post, num_rows, width, hv, first_col,
            ROWS: tl.constexpr, COLS: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """``U = pre[:, :hv]``, ``POST = silu(pre[:, hv:])`` of ``pre = Q * SCALE_INV[row]``, over the columns
    from ``first_col`` (``hv``: ``POST`` only)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    col0 = first_col + tl.program_id(1) * COLS
    cols = col0 + tl.arange(0, COLS)
    rows_ok = rows < num_rows
    inside = rows_ok[:, None] & (cols < width)[None, :]
    q = tl.load(Q + rows[:, None] * width + cols[None, :], mask=inside, other=0)
    z = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.load(SCALE_INV + rows, mask=rows_ok, other=1.0)[:, None]
    # A tile wholly in u or wholly in post stores at plain column offsets: column indices picked by
    # tl.where lose their contiguity, and the stores then went element by element (52 ms a step on
    # the H200's big config, against ~6 ms of traffic).
    if col0 + COLS <= hv:
        tl.store(U + rows[:, None] * stride_u + cols[None, :], cast(z, U.dtype.element_ty, INTERP), mask=inside)
    elif col0 >= hv:
        tl.store(POST + rows[:, None] * stride_post + (cols - hv)[None, :],
                 cast(z * tl.sigmoid(z), POST.dtype.element_ty, INTERP), mask=inside)  # fmt: skip
    else:  # a tile across the boundary (COLS does not divide hv): plain offsets, each side masked
        tl.store(U + rows[:, None] * stride_u + cols[None, :], cast(z, U.dtype.element_ty, INTERP),
                 mask=inside & (cols < hv)[None, :])  # fmt: skip
        tl.store(POST + rows[:, None] * stride_post + (cols - hv)[None, :],
                 cast(z * tl.sigmoid(z), POST.dtype.element_ty, INTERP), mask=inside & (cols >= hv)[None, :])  # fmt: skip


def silu_quantize_rows(pre: torch.Tensor, post: torch.Tensor, hv: int, *, chunk: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``post[:] = silu(pre[:, hv:])`` (as :func:`gem_kernels.hstu_gap_triton.silu_columns` writes it) and
    ``pre`` in e4m3 rows: ``(data [L, W] float8_e4m3fn, scale_inv [L] float32)``, ``pre ~= data *
    scale_inv[:, None]``. ``pre`` and ``post`` have unit column stride; ``chunk``: columns held at once
    (default :data:`ROW_CHUNK`; tests set it to reach both paths)."""
    num_rows, width = pre.shape
    data = torch.empty((num_rows, width), dtype=torch.float8_e4m3fn, device=pre.device)
    scale_inv = torch.empty(num_rows, dtype=torch.float32, device=pre.device)
    block = min(triton.next_power_of_2(max(width, 1)), chunk or ROW_CHUNK)
    # one 4096-wide row a program on 4 warps: 1.115 ms at 207,000 x 4,096 on the H200 against 1.205 for two
    # rows on 8 warps (benchmarks/pointwise_tiles.py --kernels silu_quantize, 2026-12-05)
    rows_per_program = max(1, min(16, (256 if INTERPRET else 4096) // block))
    if num_rows:
        with device_guard(pre.device):
            _silu_quantize[(triton.cdiv(num_rows, rows_per_program),)](
                pre, post, data.view(torch.uint8), scale_inv, pre.stride(0), post.stride(0), num_rows, width, hv,
                ROWS=rows_per_program, BLOCK=block, ONE_CHUNK=width <= block, INTERP=INTERPRET,
                num_warps=8 if rows_per_program * block > 4096 else 4,
            )  # fmt: skip
    return data, scale_inv


def expand_rows(data: torch.Tensor, scale_inv: torch.Tensor, hv: int, dtype: torch.dtype, *, gate: bool = True
                ) -> tuple[torch.Tensor | None, torch.Tensor]:  # fmt: skip
    """From :func:`silu_quantize_rows`'s rows: ``(u, post)`` in ``dtype``, ``u = pre[:, :hv]`` ``[L, hv]``
    and ``post = silu(pre[:, hv:])``, with ``pre = data * scale_inv[:, None]`` (exact in bf16 and fp32).
    ``gate=False``: ``post`` only (``u`` None: a kernel reads the gate's e4m3 columns itself)."""
    num_rows, width = data.shape
    u = torch.empty((num_rows, hv), dtype=dtype, device=data.device) if gate else None
    post = torch.empty((num_rows, width - hv), dtype=dtype, device=data.device)
    rows, cols = EXPAND_TILE
    first_col = 0 if gate else hv
    if num_rows:
        with device_guard(data.device):
            _expand[(triton.cdiv(num_rows, rows), triton.cdiv(width - first_col, cols))](
                data.view(torch.uint8), scale_inv, post if u is None else u, post, post.stride(0) if u is None else u.stride(0),
                post.stride(0), num_rows, width, hv, first_col, ROWS=rows, COLS=cols, INTERP=INTERPRET, num_warps=4,
            )  # fmt: skip
    return u, post
