"""HSTU's relative attention biases in the Triton jagged attention kernels (imports triton).

``r(i, j) = position_bias[j - i + N - 1] + time_bias[bucket(query_timestamps[i] - timestamps[j])]`` is
added to ``alpha <q_i, k_j>`` before the silu, with ``i, j`` the rows' positions in their sequence
(raw, not the effective positions of the mask), as :func:`gem_kernels.attention_torch.jagged_attention_torch`
does. Both are behind ``tl.constexpr`` flags: without a bias the kernels compile as before.

Time buckets, exactly
---------------------
The bucket is ``min(floor(ln(max(|dt|, 1)) / 0.301), buckets - 1)`` computed in float64 by
:func:`gem_model.jagged.time_buckets`. A float32 ``log`` in the kernel disagrees with it on integers
next to a bucket edge (84 of the 387 integers at +-1 of the 128 edges). So the kernel takes the
float32 estimate ``x`` only where it is at least ``EDGE_MARGIN`` from an integer (its error is below
1e-4: 2^-22 relative for ``lg2.approx``, 2^-24 for the int64 -> float32 rounding) and, near an edge
``c``, compares ``|dt|`` with ``edges[c]``: the smallest integer whose float64 bucket is ``c`` or more,
found with ``time_buckets`` itself on the kernel's device (:func:`bucket_edges`). The result equals the
torch function on that device for all timestamps of magnitude below 2^61 (the int64 test adds an edge to a timestamp; 2^61 s
or even ns since 1970 is far off); the masked load of the edge runs for ~1.6 % of the pairs.

Gradients
---------
``d r(i, j) = ds(i, j) / N`` (``ds`` the key-major pass's fp32 score gradient, zero where masked),
summed over heads and pairs into fp32 buffers with relaxed atomics, after a reduction in the tile:

* position: a ``BLOCK_N x BLOCK_M`` tile touches only ``BLOCK_N + BLOCK_M - 1`` relative positions.
  ``tl.gather`` shears it (row ``e`` of the sheared tile holds the diagonals ``e`` and ``e - BLOCK_N``),
  one reduction gives both diagonal sums of every row, one ``[BLOCK_N, 2]`` atomic adds them:
  ``BLOCK_N + BLOCK_M - 1`` atomics per tile pair instead of ``BLOCK_N * BLOCK_M``.
* time: per key row, the lowest and highest bucket among its queries each get one atomic with their
  row sum; the buckets strictly between (a row of ``BLOCK_M`` queries crosses at most one edge unless
  times jump) get per-pair atomics, behind a branch that is skipped when no row has any.

The buffers are striped: program ``p`` adds into copy ``p % STRIPES`` of ``[STRIPES, size]``, so
concurrent programs (neighbouring key blocks, the same relative positions and buckets) seldom hit one
address; the copies are summed once afterwards.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import INTERPRET
from gem_model.api import TIME_BUCKET_STEP, time_buckets

LOG2_TO_BUCKET = tl.constexpr(math.log(2.0) / TIME_BUCKET_STEP)
"""``log2(d) * LOG2_TO_BUCKET = ln(d) / 0.301``: ``log2`` is the GPU's native (MUFU) logarithm."""
EDGE_MARGIN = tl.constexpr(1.0 / 128.0)  # 0f3C000000 in edge_load's PTX
"""Float32 estimates closer than this to an integer are settled by the exact edge table: ~80x the
bound on the estimate's error, and only 2 * EDGE_MARGIN of the pairs (those near an edge) load it."""
ROUND_MAGIC = tl.constexpr(1.5 * 2.0**23)
ROUND_MAGIC_BITS = tl.constexpr(0x4B400000)
"""``x + 1.5 * 2^23`` (``0 <= x < 2^22``) has bits ``ROUND_MAGIC_BITS + round(x)``."""
POSITION_STRIPES = 8
"""Copies of the position gradient buffer ``[2 N - 1]`` (few programs share a relative position)."""
TIME_STRIPES = 32
"""Copies of the time gradient buffer: far fewer, hotter addresses (a few dozen buckets in use)."""
INT64_MAX = 2**63 - 1
ASM_LOADS = tl.constexpr(not INTERPRET and torch.version.hip is None)
"""Gather from the tables with inline ``ld.global.nc`` (CUDA), not ``tl.load``; see :func:`table_load`."""


def _edges(num_buckets: int, device: torch.device) -> torch.Tensor:
    """int64 ``[num_buckets + 1]``: ``edges[c]`` = the smallest ``d >= 1`` whose unclamped bucket is
    ``>= c`` (``INT64_MAX`` past the largest), by binary search over ``time_buckets`` itself (monotone),
    run on ``device``: the float64 ``log`` and division by 0.301 of CUDA and of the CPU round apart
    by an ulp now and then, which moves an edge past ~2^40 (35,000 years of seconds) by an integer or
    so, and the kernels must agree with the torch kernel on the same device."""
    wanted = torch.arange(num_buckets + 1, device=device)
    unclamped = functools.partial(time_buckets, num_buckets=2**62)
    lo = torch.ones(num_buckets + 1, dtype=torch.int64, device=device)
    hi = torch.full((num_buckets + 1,), INT64_MAX, dtype=torch.int64, device=device)
    for _ in range(64):
        mid = lo + (hi - lo) // 2
        enough = unclamped(mid) >= wanted
        hi = torch.where(enough, mid, hi)
        lo = torch.where(enough, lo, torch.where(mid < hi, mid + 1, hi))  # mid + 1 never passes INT64_MAX
    return torch.where(unclamped(lo) >= wanted, lo, torch.full_like(lo, INT64_MAX))


_EDGES: dict[tuple[int, str], torch.Tensor] = {}


def bucket_edges(num_buckets: int, device: torch.device) -> torch.Tensor:
    """The edge table of :func:`_edges` for ``device``, computed there once per bucket count."""
    key = (num_buckets, str(device))
    if key not in _EDGES:
        _EDGES[key] = _edges(num_buckets, device)
    return _EDGES[key]


@dataclass(frozen=True)
class RelativeBias:
    """The biases of one call, ready for the kernels: contiguous, int64 timestamps, the edge table."""

    position: torch.Tensor | None = None
    time: torch.Tensor | None = None
    timestamps: torch.Tensor | None = None
    query_timestamps: torch.Tensor | None = None
    edges: torch.Tensor | None = None

    @property
    def num_buckets(self) -> int:
        return self.time.numel() if self.time is not None else 1

    def label(self, grads: tuple[bool, bool] = (False, False)) -> str:
        """For tuning keys: which biases, and which of them get a gradient (``'``)."""
        parts = [name + ("'" if grad else "") for name, t, grad in
                 (("position", self.position, grads[0]), ("time", self.time, grads[1])) if t is not None]
        return "+".join(parts) or "none"

    def pointers(self, dummy: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``PB, TB, EDGES, TS, QTS`` kernel arguments; ``dummy`` stands in for an absent bias (never read)."""
        return tuple(t if t is not None else dummy for t in
                     (self.position, self.time, self.edges, self.timestamps, self.query_timestamps))


NO_BIAS = RelativeBias()


def prepare_bias(
    position_bias: torch.Tensor | None,
    time_bias: torch.Tensor | None,
    timestamps: torch.Tensor | None,
    query_timestamps: torch.Tensor | None,
    max_seq_len: int,
) -> RelativeBias:
    """Check the bias shapes (as the torch kernel does) and lay them out for the kernels.

    The kernels read ``position_bias`` at ``min(j, N - 1) - min(i, N - 1) + N - 1``: exact for every
    sequence of at most ``N = max_seq_len`` rows, which they cannot check without a host sync (the
    torch kernel raises on longer ones); the clamp only keeps longer ones inside the table.
    """
    if position_bias is not None and position_bias.shape != (2 * max_seq_len - 1,):
        raise ValueError(
            f"position_bias must be [2 * max_seq_len - 1] = [{2 * max_seq_len - 1}], got {tuple(position_bias.shape)}"
        )
    if position_bias is None and time_bias is None:
        return NO_BIAS
    # detached: the kernels read the values, the autograd function hands out the gradients
    position = None if position_bias is None else position_bias.detach().to(torch.float32).contiguous()
    if time_bias is None:
        return RelativeBias(position=position)
    assert timestamps is not None and query_timestamps is not None
    if time_bias.dim() != 1 or time_bias.numel() == 0:
        raise ValueError(f"time_bias must be a non-empty [num_buckets] vector, got {tuple(time_bias.shape)}")
    return RelativeBias(
        position=position,
        time=time_bias.detach().to(torch.float32).contiguous(),
        timestamps=timestamps.to(torch.int64).contiguous(),
        query_timestamps=query_timestamps.to(torch.int64).contiguous(),
        edges=bucket_edges(time_bias.numel(), time_bias.device),
    )


@dataclass
class BiasGrads:
    """Striped fp32 accumulators of the bias gradients (``None`` for a bias without one)."""

    position: torch.Tensor | None
    time: torch.Tensor | None

    @classmethod
    def zeros(cls, bias: RelativeBias, position: bool, time: bool, max_seq_len: int,
              device: torch.device) -> BiasGrads:
        def buffer(stripes: int, size: int) -> torch.Tensor:
            return torch.zeros((stripes, size), dtype=torch.float32, device=device)

        return cls(
            position=buffer(POSITION_STRIPES, 2 * max_seq_len - 1) if position and bias.position is not None else None,
            time=buffer(TIME_STRIPES, bias.num_buckets) if time and bias.time is not None else None,
        )

    def zero_(self) -> None:
        for t in (self.position, self.time):
            if t is not None:
                t.zero_()

    def pointers(self, dummy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.position if self.position is not None else dummy, self.time if self.time is not None else dummy)

    def result(self, bias: RelativeBias, max_seq_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The gradients, summed over stripes, scaled by ``1 / N`` and in each bias's own dtype."""
        out: list[torch.Tensor | None] = []
        for buffer, table in ((self.position, bias.position), (self.time, bias.time)):
            if buffer is None or table is None:
                out.append(None)
            else:
                out.append((buffer.sum(0) * (1.0 / max_seq_len)).to(table.dtype))
        return out[0], out[1]


@triton.jit
def table_load(ptrs):
    """Elementwise gather of fp32 table entries, in the layout of ``ptrs``.

    ``tl.load`` gets a blocked layout from Triton's coalescing pass, so a ``[M, N]`` gather feeding the
    MMA-layout scores costs a layout conversion through shared memory (64 KiB at 128 x 128), or, when
    the software pipeliner takes it, a shared-memory buffer per stage (128 x 128: 288 KiB in all, past
    the H200's 227) and the next step's index math hoisted next to this step's (spills). Inline PTX is
    an elementwise op: it takes the layout of the scores, each thread loads its own elements, and the
    small tables stay in L1.
    """
    if ASM_LOADS:
        return tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=f,l", [ptrs.to(tl.int64)],
                                         dtype=tl.float32, is_pure=True, pack=1)
    return tl.load(ptrs)


@triton.jit
def edge_load(ptrs, offset):
    """:func:`table_load` of int64 entries where ``|offset| < EDGE_MARGIN`` (0 elsewhere, nothing loaded).
    The asm tests ``offset`` itself: a boolean tile passed in would be packed into bytes first."""
    if ASM_LOADS:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .f32 a; abs.f32 a, $2; setp.lt.f32 p, a, 0f3C000000; mov.b64 $0, 0; "
            "@p ld.global.nc.b64 $0, [$1]; }",
            "=l,l,f", [ptrs.to(tl.int64), offset], dtype=tl.int64, is_pure=True, pack=1,
        )
    return tl.load(ptrs, mask=tl.abs(offset) < EDGE_MARGIN, other=0)


@triton.jit
def _log2(x):
    if ASM_LOADS:  # one MUFU op; tl.log2 is libdevice's exact log2f, ~17 FMA-pipe instructions
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.log2(x)


@triton.jit
def time_bucket(query_t, key_t, EDGES, num_buckets):
    """``time_buckets(query_t - key_t, num_buckets)`` of int64 timestamps (vectors shaped to broadcast
    to the tile), exactly (see the module docstring).

    Rounds with the 1.5 * 2^23 trick (adding it leaves the nearest integer in the low mantissa bits),
    not ``floor`` and a float -> int conversion: those run on the quarter-rate conversion pipe, which
    the silu's tanh and the log already load. The int64 difference only lives long enough for its
    float32 conversion: the exact test near an edge compares the timestamps themselves, so that no
    int64 tile is held while the edge loads are in flight (it spilled at 128 x 64)."""
    x = _log2(tl.maximum(tl.abs((query_t - key_t).to(tl.float32)), 1.0)) * LOG2_TO_BUCKET
    rounded = x + ROUND_MAGIC
    offset = x - (rounded - ROUND_MAGIC)  # x minus its nearest integer c, in [-0.5, 0.5]
    nearest = rounded.to(tl.int32, bitcast=True) - ROUND_MAGIC_BITS  # c
    near = tl.abs(offset) < EDGE_MARGIN
    edge = edge_load(EDGES + tl.minimum(nearest, num_buckets), offset)
    # near an edge: |query_t - key_t| < edges[c], without the subtraction's overflow
    exact = (query_t < key_t + edge) & (key_t < query_t + edge)
    below = tl.where(near, exact, offset < 0.0)
    return tl.maximum(tl.minimum(nearest - below.to(tl.int32), num_buckets - 1), 0)


@triton.jit
def relative_bias(PB, TB, EDGES, query_idx, key_idx, query_t, key_t, pos_offset, num_buckets,
                  HAS_POS: tl.constexpr, HAS_TIME: tl.constexpr):
    """``r`` (fp32) and the time bucket (int32; 0 without a time bias) of a tile, from query and key
    index and timestamp vectors shaped to broadcast to it (``[M, 1]`` and ``[1, N]``, either way
    round). The clamps act on the vectors, not per element (``pos_offset = N - 1``)."""
    r = 0.0
    bucket = 0
    if HAS_POS:
        relative = tl.minimum(key_idx, pos_offset) - tl.minimum(query_idx, pos_offset) + pos_offset
        r = table_load(PB + relative)
    if HAS_TIME:
        bucket = time_bucket(query_t, key_t, EDGES, num_buckets)
        r = r + table_load(TB + bucket)
    return r, bucket


@triton.jit
def position_grad(DPB, x, base, size, ROWS: tl.constexpr, COLS: tl.constexpr):
    """``DPB[base + a - b] += x[a, b]`` for a ``[ROWS, COLS]`` tile (keys ``a`` on rows, queries ``b``
    on columns), diagonals summed in the tile first: ``ROWS + COLS - 1`` atomics instead of one per
    element. Indices outside ``[0, size)`` belong to padding (``x`` is 0 there).

    Every cross-warp reduction and layout conversion here goes through shared memory behind a
    barrier, which also stalls the step's MMAs: hence one joined reduction and one atomic."""
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    if ROWS >= COLS:
        # y[e, b] = x[(b + e) % ROWS, b]: row e holds diagonal a - b = e where b + e < ROWS, else e - ROWS
        wrapped = rows[:, None] + cols[None, :]
        y = tl.gather(x, wrapped % ROWS, 0)
        second = wrapped >= ROWS
        # both diagonals of a row in one reduction (each cross-warp reduction is a barrier)
        sums = tl.sum(tl.join(tl.where(second, 0.0, y), tl.where(second, y, 0.0)), 1)
        diagonal = rows[:, None]
        far_used = diagonal > ROWS - COLS  # rows that wrap at all
        step: tl.constexpr = ROWS
    else:
        # y[a, e] = x[a, (a - e) % COLS]: column e holds diagonal e where a >= e, else e - COLS
        shift = rows[:, None] - cols[None, :]
        y = tl.gather(x, (shift + COLS) % COLS, 1)
        second = shift < 0
        sums = tl.sum(tl.join(tl.where(second, 0.0, y), tl.where(second, y, 0.0)), 0)
        diagonal = cols[:, None]
        far_used = diagonal > 0
        step: tl.constexpr = COLS
    # [ROWS or COLS, 2] indices and masks straight from aranges, so that they take the atomics' layout
    # as computed; from the sums, or joined from vectors, each would be one more layout conversion
    # through shared memory behind a barrier.
    far = tl.arange(0, 2)[None, :]
    indices = base + diagonal - step * far
    inside = (indices >= 0) & (indices < size) & ((far == 0) | far_used)
    tl.atomic_add(DPB + indices, sums, mask=inside, sem="relaxed")


@triton.jit
def time_grad(DTB, x, bucket, num_buckets):
    """``DTB[bucket[a, b]] += x[a, b]``: per row, one atomic for its lowest bucket and one for its
    highest, per-element atomics only for buckets in between (rare: skipped by a branch).

    The row atomics are unmasked (a row without pairs adds 0 to bucket 0): each mask would be one more
    layout conversion through shared memory, behind a barrier, to the atomics' layout."""
    nonzero = x != 0.0
    lowest = tl.min(tl.where(nonzero, bucket, num_buckets), 1)
    highest = tl.max(tl.where(nonzero, bucket, -1), 1)
    at_lowest = tl.sum(tl.where(bucket == lowest[:, None], x, 0.0), 1)
    at_highest = tl.where(highest > lowest, tl.sum(tl.where(bucket == highest[:, None], x, 0.0), 1), 0.0)
    # one [ROWS, 2] atomic: each operand is converted to the atomics' layout once, not twice
    targets = tl.join(tl.minimum(lowest, num_buckets - 1), tl.maximum(highest, 0))
    tl.atomic_add(DTB + targets, tl.join(at_lowest, at_highest), sem="relaxed")
    if tl.max(highest - lowest, 0) > 1:
        between = nonzero & (bucket > lowest[:, None]) & (bucket < highest[:, None])
        tl.atomic_add(DTB + bucket, x, mask=between, sem="relaxed")


@triton.jit
def _time_bucket_kernel(DT, OUT, EDGES, n, num_buckets, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    dt = tl.load(DT + offsets, mask=inside, other=0)
    tl.store(OUT + offsets, time_bucket(dt, dt * 0, EDGES, num_buckets), mask=inside)


def time_buckets_triton(dt: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """The kernels' bucket of each int64 difference in ``dt`` (int32, same shape): for tests and the
    benchmark's check against :func:`gem_model.jagged.time_buckets` on the device that runs them."""
    flat = dt.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(flat.shape, dtype=torch.int32, device=dt.device)
    if flat.numel() > 0:
        block = 1024
        _time_bucket_kernel[(triton.cdiv(flat.numel(), block),)](
            flat, out, bucket_edges(num_buckets, dt.device), flat.numel(), num_buckets, BLOCK=block
        )
    return out.reshape(dt.shape)
