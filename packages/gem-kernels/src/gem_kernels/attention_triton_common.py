"""Helpers shared by the jagged attention kernels: device and grid sizes, the self-resetting work
queue, masks, silu, dot and loads (the launcher is :mod:`gem_kernels.launcher`).

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


TMA_LOADS = True
"""The tiles each kernel's inner loop walks (keys and values in the forward and the dq pass, queries
and output gradients in the dk/dv pass) come by tensor descriptors where :func:`tma_loads` allows;
False keeps pointer loads everywhere (read at call time)."""


def tma_loads(*tensors: torch.Tensor) -> bool:
    """Whether the kernels may load whole tiles of these ``[L, H, D]`` tensors by tensor descriptors:
    on a GPU that has them (compute capability 9.0 or later, or in the interpreter), 16-bit tensors of
    one dtype whose heads sit side by side in a row (``stride(1) == D``, ``D`` a power of two, so no
    padding), with 16-byte aligned rows and base. Sets Triton's allocator for the descriptors if so."""
    if not TMA_LOADS or tensors[0].dtype not in (torch.bfloat16, torch.float16):
        return False
    if not INTERPRET and (not tensors[0].is_cuda or not has_tma(tensors[0].device.index or 0)):
        return False
    for t in tensors:
        d = t.shape[2]
        if t.dtype != tensors[0].dtype or d != pow2_at_least(d) or d < 16 or t.stride(2) != 1 or t.stride(1) != d:
            return False
        if (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    ensure_allocator()
    return True


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global memory for the descriptors a kernel builds on the device (128 bytes each, per program)."""
    return torch.empty(size, dtype=torch.int8, device="cpu" if INTERPRET else "cuda")


def ensure_allocator() -> None:
    """Triton's allocator for device-built tensor descriptors, unless the caller set one. Triton keeps it
    in a context variable, which autograd's device thread starts without: so every launch checks."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


@triton.jit
def row_descriptor(X, num_rows, row_width, stride_row, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A tensor descriptor over ``X`` seen as ``[num_rows, row_width]`` (a row holds every head), handing
    out ``[BLOCK_ROWS, BLOCK_D]`` tiles; rows past ``num_rows`` read as zeros."""
    return tl.make_tensor_descriptor(X, shape=[num_rows, row_width], strides=[stride_row, 1],
                                     block_shape=[BLOCK_ROWS, BLOCK_D])


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= ``n`` (>= 1), in plain Python: ``triton.next_power_of_2`` is a
    constexpr function and costs microseconds per host call."""
    return 1 << max(0, n - 1).bit_length()


def dim_block(dim: int) -> int:
    """Head dims are padded (masked) to a power of two of at least 16, the smallest ``tl.dot`` size."""
    return max(16, pow2_at_least(dim))


def length_buckets(max_seq_len: int, num_rows: int, num_seqs: int) -> tuple[int, int]:
    """Tuning-key buckets: ``max_seq_len`` and the mean length ``L / B`` (known on the host without a
    sync), each rounded up to a power of two. Batches of short sequences (s = 0.3) tune apart from
    batches of long ones with the same ``max_seq_len``: their best query block is smaller."""
    mean = -(-num_rows // max(1, num_seqs))
    return max(16, pow2_at_least(max_seq_len)), max(16, pow2_at_least(mean))


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def has_tma(device_index: int) -> bool:
    """Whether the GPU has the tensor memory accelerator (compute capability 9.0 or later)."""
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def device_guard(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the one holding the tensors."""
    if device.type != "cuda" or device.index is None or device.index == torch.cuda.current_device():
        return contextlib.nullcontext()
    return torch.cuda.device(device)


def num_programs(device: torch.device, programs_per_sm: int, tile_bound: int) -> int:
    """Persistent grid: enough programs to fill the device, never more than there can be tiles."""
    if INTERPRET:
        return max(1, min(2, tile_bound))  # two: the tests also see a program that finds the queue empty
    return max(1, min(num_sms(device.index or 0) * programs_per_sm, tile_bound))


def current_stream(device_index: int) -> int:
    """The raw current stream, as Triton's launcher gets it."""
    from triton.runtime.driver import driver

    return driver.active.get_current_stream(device_index)  # type: ignore[no-any-return]


_QUEUES: dict[tuple[int, int], torch.Tensor] = {}


def queue_counter(device: torch.device) -> torch.Tensor:
    """The work queue of a persistent kernel: int32 ``[next tile, programs done]``, zero at launch.

    The kernels put it back to zero themselves (the last program to finish does, see
    :func:`release_queue`), so one buffer per (device, stream) serves every launch without a memset.
    Kernels on one stream run one after another; other streams get their own buffer. Under the
    interpreter, and while a CUDA graph is being captured, each launch gets a fresh zeroed buffer.
    """
    if INTERPRET or device.type != "cuda":
        return torch.zeros(2, dtype=torch.int32, device=device)
    key = (device.index, current_stream(device.index))
    counter = _QUEUES.get(key)
    if counter is None:
        counter = torch.zeros(2, dtype=torch.int32, device=device)
        if torch.cuda.is_current_stream_capturing():
            return counter  # its zeroing is part of the graph: never reuse it outside
        _QUEUES[key] = counter
    return counter


@triton.jit
def release_queue(COUNTER):
    """Called by every program as its last act: the last one to finish zeroes the queue for the next
    launch. Atomics are acq_rel, so every program's final claim precedes its ``done`` increment, and
    the zeroing follows all of them."""
    done = tl.atomic_add(COUNTER + 1, 1)
    if done == tl.num_programs(0) - 1:
        tl.atomic_xchg(COUNTER, 0)
        tl.atomic_xchg(COUNTER + 1, 0)


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
def _silu_exact(z):
    sig = tl.sigmoid(z)
    return z * sig, sig * (1.0 + z * (1.0 - sig))


@triton.jit
def _silu_tanh(h, APPROX: tl.constexpr):
    # sigmoid(z) = (1 + tanh(z / 2)) / 2, so with h = z / 2 and t = tanh(h):
    # silu = h + h t and silu' = (1 + t) / 2 * (1 + h - h t).
    t = _tanh(h, APPROX)
    ht = h * t
    return h + ht, (0.5 + 0.5 * t) * (1.0 + h - ht)


@triton.jit
def silu_and_grad(s, alpha, SILU: tl.constexpr):
    """``silu(alpha * s)`` and ``silu'(alpha * s)`` from raw scores ``s`` (fp32)."""
    if SILU == 0:
        return _silu_exact(s * alpha)
    return _silu_tanh(s * (0.5 * alpha), SILU == 2)


@triton.jit
def silu_and_grad_biased(s, alpha, r, SILU: tl.constexpr):
    """``silu(alpha * s + r)`` and its derivative: the same algebra with the relative bias ``r``."""
    if SILU == 0:
        return _silu_exact(s * alpha + r)
    return _silu_tanh(s * (0.5 * alpha) + 0.5 * r, SILU == 2)


@triton.jit
def silu_grad(z):
    """``silu'(z)`` in fp32, exact (an epilogue's once-per-element cost, not the scores' inner loop)."""
    sig = tl.sigmoid(z)
    return sig * (1.0 + z * (1.0 - sig))


@triton.jit
def allowed(query_idx, key_idx, history_len, max_attn_len, HAS_WINDOW: tl.constexpr):
    """KERNELS.md mask ``i == j or 0 < p(i) - p(j) <= W`` on a column and a row of indices (shapes
    ``[M, 1]`` and ``[1, N]``, either way round). Positions are clamped on the vectors; per element it
    costs two compares and an or (two more with a window): ``p(j) < p(i)`` is ``0 < p(i) - p(j)``
    without the subtraction, and ``p(j) >= p(i) - W`` is ``p(i) - p(j) <= W``."""
    p_query = tl.minimum(query_idx, history_len)
    p_key = tl.minimum(key_idx, history_len)
    keep = p_key < p_query
    if HAS_WINDOW:
        keep = keep & (p_key >= p_query - max_attn_len)
    return keep | (query_idx == key_idx)


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
