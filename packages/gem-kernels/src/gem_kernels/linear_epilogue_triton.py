"""The HSTU block's two GEMMs with the pointwise work beside them in their epilogues (imports triton).

    pre = x @ weight.T + bias; post = silu(pre[:, silu_from:])     # linear_silu: the uvqk projection
    out = residual + (x @ weight.T + bias)                          # linear_residual: the output projection

Today the block runs cuBLAS and then a pass for each: :func:`gem_kernels.hstu_gap_triton.silu_columns`
reads three quarters of ``pre`` back and writes ``post``, and the residual add reads both operands and
writes the sum (on the H200's big config, 5.0 and 2.9 ms of a 185 ms step over eight blocks). Here the
GEMM's epilogue does it from the accumulator it holds: the GEMMs are compute-bound (K = 1,024), so the
extra loads and stores have time to overlap with the MMAs of the next tile.

The kernel is persistent (one program an SM walks the output tiles in grouped order) and reads its
operands through tensor descriptors (TMA on Hopper).

- ``post`` is ``silu`` of ``pre`` as stored in the output dtype, so it is bit-identical to what
  :func:`silu_columns` makes from this ``pre``.
- The residual is added to the fp32 accumulator before the one rounding (unfused: two roundings, the
  linear's output and the sum).

Whether they beat cuBLAS plus the passes is for the device to say: ``benchmarks/linear_epilogue.py``
times both on the big config's shapes. ``gem_kernels.hstu_block`` runs them behind switches that stay
off until an end-to-end A/B says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gem_kernels.attention_triton_common import (
    INTERPRET,
    cast,
    device_guard,
    dot,
    ensure_allocator,
    num_programs,
)


@dataclass(frozen=True)
class GemmConfig:
    """One tiling of the GEMM: the output tile, the K step, the pipeline depth and the warps."""

    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int
    group_m: int = 8
    subtile: bool = False
    """The epilogue in two halves of ``block_n / 2`` columns: half the shared memory for its stores, which
    leaves room for one more pipeline stage."""


CONFIGS: dict[str, GemmConfig] = {
    "m128n256k64": GemmConfig(128, 256, 64, 3, 8),
    "m128n128k64": GemmConfig(128, 128, 64, 4, 8),
    "m128n128k64w4": GemmConfig(128, 128, 64, 4, 4),
    "m256n128k64": GemmConfig(256, 128, 64, 3, 8),
    "m128n256k64s3": GemmConfig(128, 256, 64, 3, 8, subtile=True),
    "m128n256k64s4": GemmConfig(128, 256, 64, 4, 8, subtile=True),
}
"""The candidates ``benchmarks/linear_epilogue.py`` times; the first is Triton's Hopper tutorial's choice for
large bf16 GEMMs. The interpreter runs every config with 16-wide tiles, 32 for the halved epilogues
(:func:`_tiles`)."""
DEFAULT_CONFIG = "m128n256k64"


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: ``GROUP_M`` row tiles share each column sweep, so the weight's tiles stay in L2."""
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows_in_group
    pid_n = (tile % per_group) // rows_in_group
    return pid_m, pid_n


SILU, RESIDUAL = 1, 2
"""The epilogues: ``silu`` of the columns from ``SILU_FROM`` into a second output, or a residual added."""
_SILU, _RESIDUAL = tl.constexpr(SILU), tl.constexpr(RESIDUAL)  # as the kernel sees them


@triton.jit
def _linear_epilogue(X, W, BIAS, OUT, EXTRA, M, N, K, SILU_FROM, HAS_BIAS: tl.constexpr, EPILOGUE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     SUBTILE: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """``OUT = X @ W^T (+ BIAS)``, then by ``EPILOGUE``: 0 nothing more; ``SILU``: ``EXTRA = silu(OUT[:,
    SILU_FROM:])`` (``EXTRA [M, N - SILU_FROM]``; ``SILU_FROM`` a multiple of ``BLOCK_N``, the host checks,
    so a tile is wholly before it or wholly after); ``RESIDUAL``: ``OUT = EXTRA + X @ W^T (+ BIAS)``
    (``EXTRA [M, N]``). Row-major, contiguous ``X [M, K]``, ``W [N, K]``, ``OUT [M, N]``."""
    x_desc = tl.make_tensor_descriptor(X, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    w_desc = tl.make_tensor_descriptor(W, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    PIECE: tl.constexpr = BLOCK_N // 2 if SUBTILE else BLOCK_N
    out_desc = tl.make_tensor_descriptor(OUT, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, PIECE])
    if EPILOGUE == _SILU:
        extra_desc = tl.make_tensor_descriptor(EXTRA, shape=[M, N - SILU_FROM], strides=[N - SILU_FROM, 1],
                                               block_shape=[BLOCK_M, PIECE])  # fmt: skip
    else:
        extra_desc = tl.make_tensor_descriptor(EXTRA, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, PIECE])
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = x_desc.load([off_m, ki * BLOCK_K])
            b = w_desc.load([off_n, ki * BLOCK_K])
            acc = dot(a, b.T, acc, False, INTERP)
        if SUBTILE:
            left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, PIECE)), (0, 2, 1)))
            _finish(left, off_m, off_n, BIAS, OUT, EXTRA, out_desc, extra_desc, N, SILU_FROM, HAS_BIAS, EPILOGUE, PIECE, INTERP)
            _finish(right, off_m, off_n + PIECE, BIAS, OUT, EXTRA, out_desc, extra_desc, N, SILU_FROM, HAS_BIAS, EPILOGUE, PIECE,
                    INTERP)  # fmt: skip
        else:
            _finish(acc, off_m, off_n, BIAS, OUT, EXTRA, out_desc, extra_desc, N, SILU_FROM, HAS_BIAS, EPILOGUE, PIECE, INTERP)


@triton.jit
def _finish(acc, off_m, off_n, BIAS, OUT, EXTRA, out_desc, extra_desc, N, SILU_FROM, HAS_BIAS: tl.constexpr,
            EPILOGUE: tl.constexpr, WIDTH: tl.constexpr, INTERP: tl.constexpr):  # fmt: skip
    """The epilogue of ``WIDTH`` columns of a tile from ``off_n``: bias, residual, the store, the silu."""
    if HAS_BIAS:
        cols = off_n + tl.arange(0, WIDTH)
        acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if EPILOGUE == _RESIDUAL:
        acc += extra_desc.load([off_m, off_n]).to(tl.float32)
    out = cast(acc, OUT.dtype.element_ty, INTERP)
    out_desc.store([off_m, off_n], out)
    if EPILOGUE == _SILU:
        if off_n >= SILU_FROM:
            z = out.to(tl.float32)
            extra_desc.store([off_m, off_n - SILU_FROM], cast(z * tl.sigmoid(z), EXTRA.dtype.element_ty, INTERP))


def _tiles(config: GemmConfig) -> GemmConfig:
    """The config as launched: the interpreter runs 16-wide tiles (the tests' tiny shapes, in seconds)."""
    if INTERPRET:
        return GemmConfig(16, 32 if config.subtile else 16, 16, 1, 1, 2, config.subtile)
    return config


def fits_epilogue(silu_from: int, n: int, k: int, config: str = DEFAULT_CONFIG, dtype_bytes: int = 2) -> bool:
    """Whether the kernel takes these sizes with ``config``: ``silu_from`` (0 for ``linear_residual``)
    a multiple of its tile width, 16-byte rows for the tensor descriptors."""
    tiles = _tiles(CONFIGS[config])
    return 0 <= silu_from < n and silu_from % tiles.block_n == 0 and (k * dtype_bytes) % 16 == 0


def check_shapes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_from: int,
                 config: GemmConfig) -> None:  # fmt: skip
    """Raise ``ValueError`` naming what does not fit the kernel."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"linear epilogue: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K] and [N, K]")
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"linear epilogue: x and weight must share a 16-bit dtype, got {x.dtype} and {weight.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"linear epilogue: bias {tuple(bias.shape)} is not [N] = [{weight.shape[0]}]")
    if not 0 <= silu_from <= weight.shape[0] or silu_from % config.block_n:
        raise ValueError(f"linear epilogue: silu_from={silu_from} must be a multiple of the tile width "
                         f"{config.block_n} within N = {weight.shape[0]}")  # fmt: skip
    for name, t in (("x", x), ("weight", weight)):
        if (t.shape[1] * t.element_size()) % 16:
            raise ValueError(f"linear epilogue: {name}'s rows must be a multiple of 16 bytes (TMA), got {t.shape[1]} columns")


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, extra: torch.Tensor,
            silu_from: int, epilogue: int, tiles: GemmConfig) -> None:  # fmt: skip
    m, n = out.shape
    if m == 0:
        return
    ensure_allocator()
    num_tiles = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    with device_guard(x.device):
        _linear_epilogue[(num_programs(x.device, 1, num_tiles),)](
            x, weight, bias if bias is not None else x, out, extra, m, n, x.shape[1], silu_from,
            HAS_BIAS=bias is not None, EPILOGUE=epilogue, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
            BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m, SUBTILE=tiles.subtile, INTERP=INTERPRET, num_warps=tiles.warps,
            num_stages=tiles.stages,
        )  # fmt: skip


def _check_buffer(name: str, t: torch.Tensor, shape: tuple[int, int], like: torch.Tensor) -> None:
    if t.shape != shape or t.dtype != like.dtype or not t.is_contiguous() or t.device != like.device:
        raise ValueError(f"linear epilogue: {name} must be a contiguous {like.dtype} {list(shape)} on {like.device}, "
                         f"got {t.dtype} {list(t.shape)} on {t.device}")  # fmt: skip


def linear_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_from: int, *,
                write_post: bool = True, config: str = DEFAULT_CONFIG,
                post: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(pre, post)``: ``pre = x @ weight.T + bias`` ``[M, N]`` and ``post = silu(pre[:, silu_from:])``
    (left unwritten with ``write_post=False``, for timing the GEMM alone). ``x``, ``weight`` one 16-bit
    dtype; ``bias`` (any float dtype, added in fp32) or None; ``post``: a contiguous ``[M, N - silu_from]``
    tensor of ``x``'s dtype to write into (else a new one)."""
    tiles = _tiles(CONFIGS[config])
    check_shapes(x, weight, bias, silu_from, tiles)
    x, weight = x.contiguous(), weight.contiguous()
    m, n = x.shape[0], weight.shape[0]
    pre = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if post is None:
        post = torch.empty((m, n - silu_from), dtype=x.dtype, device=x.device)
    _check_buffer("post", post, (m, n - silu_from), x)
    # no post columns: no descriptor over an empty tensor
    _launch(x, weight, bias, pre, post, silu_from, SILU if write_post and silu_from < n else 0, tiles)
    return pre, post


def linear_residual(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, *,
                    config: str = DEFAULT_CONFIG) -> torch.Tensor:  # fmt: skip
    """``residual + (x @ weight.T + bias)`` ``[M, N]``, rounded once; ``residual`` contiguous, ``x``'s dtype."""
    tiles = _tiles(CONFIGS[config])
    check_shapes(x, weight, bias, 0, tiles)
    x, weight = x.contiguous(), weight.contiguous()
    m, n = x.shape[0], weight.shape[0]
    _check_buffer("residual", residual, (m, n), x)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _launch(x, weight, bias, out, residual, 0, RESIDUAL, tiles)
    return out
