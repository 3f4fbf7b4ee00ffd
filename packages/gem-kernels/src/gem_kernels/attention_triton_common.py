"""Device helpers shared by the jagged attention kernels: scheduling, masks, silu, dot, loads.

Imported only when a Triton kernel is used (it imports triton at module level).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

from gem_kernels.availability import interpreter_enabled

INTERPRET = interpreter_enabled()
"""Frozen at import: ``triton.jit`` decides interpreted vs compiled when this module is imported."""

SILU_EXACT, SILU_TANH, SILU_TANH_APPROX = 0, 1, 2
CHUNK = 128
"""Sequences scanned at once by the in-kernel scheduler (one vector load of offsets per chunk)."""


def silu_mode(dtype: torch.dtype) -> int:
    """fp32 keeps the exact sigmoid. 16-bit inputs use ``tanh.approx.f32`` (one MUFU op instead of an
    exp and a reciprocal; its ~2^-11 error is below bf16 rounding). The interpreter cannot run inline
    PTX, so it checks the same tanh-based algebra with an exact tanh."""
    if dtype == torch.float32:
        return SILU_EXACT
    if INTERPRET or torch.version.hip is not None:
        return SILU_TANH
    return SILU_TANH_APPROX


def dim_block(dim: int) -> int:
    """Head dims are padded (masked) to a power of two of at least 16, the smallest ``tl.dot`` size."""
    return max(16, triton.next_power_of_2(dim))


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the one holding the tensors."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def num_programs(device: torch.device, programs_per_sm: int, tile_bound: int) -> int:
    """Persistent grid: enough programs to fill the device, never more than there can be tiles."""
    if INTERPRET:
        return max(1, min(2, tile_bound))  # two: the tests also see a program that finds the queue empty
    return max(1, min(num_sms(device.index or 0) * programs_per_sm, tile_bound))


def fixed_block_warps(block_m: int, block_n: int) -> int:
    """Warps for tile sizes set by hand: two warpgroups once a tile's fp32 scores would crowd one."""
    return 1 if INTERPRET else (8 if block_m * block_n >= 128 * 64 else 4)


def launch_once_tuned(tuner: object, launch: object, buffers: list[torch.Tensor]) -> None:
    """Launch a persistent kernel; if this call autotuned it, zero its queue (and accumulators) and
    launch again, since autotuning ran it several times on the same buffers."""
    cache = getattr(tuner, "cache", None)
    before = len(cache) if cache is not None else 0
    launch()  # type: ignore[operator]
    if cache is not None and len(cache) != before:
        for buffer in buffers:
            buffer.zero_()
        launch()  # type: ignore[operator]


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, INTERP: tl.constexpr):
    # Triton's interpreter multiplies bf16 operands as raw integers; fp32 holds bf16 values exactly.
    if INTERP:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")  # fp32 inputs must not drop to tf32
    return tl.dot(a, b, acc)


@triton.jit
def cast(x, dtype: tl.constexpr, INTERP: tl.constexpr):
    """``x.to(dtype)`` rounding to nearest even, as the GPU does (Triton's interpreter truncates to bf16)."""
    if INTERP:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def load_tile(ptrs, rows_ok, cols_ok, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    # Unchecked loads on interior tiles keep them vectorised and free of predicate math.
    if CHECK_ROWS:
        if CHECK_COLS:
            return tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
        return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    if CHECK_COLS:
        return tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _tanh(x, APPROX: tl.constexpr):
    if APPROX:
        return tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def silu_and_grad(s, alpha, SILU: tl.constexpr):
    """``silu(alpha * s)`` and ``silu'(alpha * s)`` from raw scores ``s`` (fp32)."""
    if SILU == 0:
        z = s * alpha
        sig = tl.sigmoid(z)
        return z * sig, sig * (1.0 + z * (1.0 - sig))
    # sigmoid(z) = (1 + tanh(z / 2)) / 2, so with h = z / 2 and t = tanh(h):
    # silu = h + h t and silu' = (1 + t) / 2 * (1 + h - h t).
    h = s * (0.5 * alpha)
    t = _tanh(h, SILU == 2)
    ht = h * t
    return h + ht, (0.5 + 0.5 * t) * (1.0 + h - ht)


@triton.jit
def allowed(query_idx, key_idx, history_len, max_attn_len, HAS_WINDOW: tl.constexpr):
    """KERNELS.md mask on broadcastable index tensors: ``i == j`` or ``0 < p(i) - p(j) <= W``."""
    gap = tl.minimum(query_idx, history_len) - tl.minimum(key_idx, history_len)
    keep = (gap > 0) | (query_idx == key_idx)
    if HAS_WINDOW:
        keep = keep & (gap <= max_attn_len)
    return keep


@triton.jit
def scan_chunk(SEQ_OFFSETS, chunk0, num_seqs, num_heads, tiles_before, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Tiles (``BLOCK`` rows x one head) of the sequences ``chunk0 .. chunk0 + CHUNK``: per sequence its
    tile count and the queue index just past its last tile."""
    seqs = chunk0 + tl.arange(0, CHUNK)
    inside = seqs < num_seqs
    starts = tl.load(SEQ_OFFSETS + seqs, mask=inside, other=0)
    ends = tl.load(SEQ_OFFSETS + seqs + 1, mask=inside, other=0)
    tiles = ((ends - starts + BLOCK - 1) // BLOCK).to(tl.int32) * num_heads
    return tiles, tl.cumsum(tiles, 0) + tiles_before


@triton.jit
def locate_tile(tile, chunk0, tiles, tiles_end, tiles_before, SEQ_OFFSETS, BLOCK: tl.constexpr):
    """Sequence, its first row and length, head, block index (in sequence order) and block count of
    queue entry ``tile``. Queue order: sequence, then head, then block, so that programs running at
    the same time read the same K/V rows and find them in L2."""
    before = tiles_end <= tile
    seq = chunk0 + tl.sum(before.to(tl.int32))
    first_tile = tiles_before + tl.sum(tl.where(before, tiles, 0))
    seq_start = tl.load(SEQ_OFFSETS + seq).to(tl.int64)  # row * stride can pass 2^31 with int32 offsets
    seq_len = (tl.load(SEQ_OFFSETS + seq + 1) - seq_start).to(tl.int32)
    blocks = (seq_len + BLOCK - 1) // BLOCK
    rank = tile - first_tile
    head = rank // blocks
    return seq, seq_start, seq_len, head, rank - head * blocks, blocks


@triton.jit
def history_length(NUM_TARGETS, seq, seq_len, HAS_TARGETS: tl.constexpr):
    """``n - t`` clamped to ``[0, n]``; clamping leaves the mask of KERNELS.md unchanged."""
    if HAS_TARGETS:
        targets = tl.load(NUM_TARGETS + seq).to(tl.int32)
        return tl.minimum(tl.maximum(seq_len - targets, 0), seq_len)
    return seq_len
