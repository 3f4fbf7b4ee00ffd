"""MXFP8 GEMM ``C = A @ B.T`` consuming MX operands directly (no dequantized copy in memory).

Two implementations of the same contract (A ``[M, K]``, B ``[N, K]``, both with blocks of 32 along K;
the result equals :func:`gem_precision.mx_reference.mx_gemm_reference` up to the order of float32
accumulation, and in the fp8 variant below the fp8 MMA's shortened accumulation):

- :func:`mx_gemm_triton`, for Hopper (and Ada). Hopper has no block-scaled MMA (Triton's
  ``tl.dot_scaled`` emulates it: 123-201 TFLOP/s here), so a 32-wide K block's scales must be
  applied outside the tensor cores. Two variants; by default the autotuner chooses among the
  bf16-dequant configs only (they meet the 1e-5 contract), ``fp8_accumulation=True`` adds the
  fp8-fold ones:

  ``DEQUANT=0`` (fp8 fold): one fp8 ``tl.dot`` per 32-wide K slice into a temporary, folded into
  the float32 accumulator times the outer product of the slice's scales (a multiply and an FMA per
  output element per 32 K, on the CUDA cores). Roofline at 8192^3 on an H200 SM (4096 fp8 MAC/clk
  on the tensor cores, 128 float32 ops/clk on the CUDA cores), per 32-K slice of a 128x128 tile:
  tensor cores 128x128x32 / 4096 = 128 clk, fold 2 x 16384 / 128 = 256 clk. The fold bounds it at
  ~990 TFLOP/s with perfect overlap, ~660 TFLOP/s when, as Triton does, each wgmma is waited for
  before its fold (128 + 256 clk, one CTA of 8 warps per SM at 254 registers). Measured: 324
  TFLOP/s (64x128 tiles, 4 warps); the rest is issue overhead of the fold, the scale loads and the
  wgmma waits. Accuracy: Hopper's fp8 MMA does not accumulate in full float32 (it aligns the 32
  products to the largest and keeps ~14 mantissa bits, as DeepSeek-V3 measured), so each slice
  sum has a relative error of ~2**-14.5 and the result ~4.5e-5 against the float32 reference. The
  usual cure, promoting partial sums to float32 more often, is already at its limit here: every
  wgmma (fp8 K = 32, its minimum) is promoted.

  ``DEQUANT=1`` (bf16 dequant): each fp8 slice of A and B is multiplied by its scales into bfloat16
  in registers (exact: 3 mantissa bits times a power of two; values below 2**-126 lose bits), and
  one bf16 wgmma chain accumulates the whole K in float32 (bf16 MMAs keep float32 partial sums:
  measured 5.1e-7 against the reference at 8192^3 on the H200, at 299 TFLOP/s against the fold's
  324). CUDA-core work is (BLOCK_M + BLOCK_N) x 32 conversions per slice instead of
  BLOCK_M x BLOCK_N folds, against bf16 tensor-core time, twice fp8's: 256 clk per 128x128x32,
  ~190-300 clk of conversions. Its ceiling is the bf16 rate, i.e. the emulated path (dequantize +
  bf16 mm, 698 TFLOP/s, 97% of bf16), without the dequantized copy in memory.

  The issue's ">= 2x the emulated path" cannot be met on Hopper: the emulated path already runs at
  the bf16 tensor-core rate, and fp8's is 2x bf16 only with free scaling; a plain fp8 GEMM
  (``torch._scaled_mm``, per-tensor scales) reaches 1.8x on this H200.
- :func:`mx_gemm_native`: ``torch._scaled_mm`` with e8m0 block scales (cuBLAS block scaling, CUDA
  capability 10.0 and later). Scales are rearranged into cuBLAS's 128x4 tiled layout first.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from gem_precision.mx_reference import MX_BLOCK, MXTensor
from gem_precision.triton_common import check_triton_device, interpreting


def _configs(fp8_accumulation: bool = True) -> list[triton.Config]:
    # (BLOCK_M, BLOCK_N, SUB_K, num_stages, num_warps, DEQUANT); all compile for sm_90 without
    # register spills (tests/compile_sm90.py checks the first of each kind).
    # fp8 fold (DEQUANT 0): Triton waits for each wgmma before folding it, so MMA/fold overlap comes
    # from several CTAs per SM: small tiles (fewer registers, higher occupancy) compete with large
    # ones (more reuse). bf16 dequant (DEQUANT 1): the CUDA-core work is (BLOCK_M + BLOCK_N) * 32
    # per 32 K instead of BLOCK_M * BLOCK_N, so large tiles pay off, and the accumulator stays in
    # the tensor cores across K (tl.dot(a, b, acc)).
    shapes = (
        (128, 128, 1, 4, 8, 0), (64, 128, 1, 4, 4, 0), (64, 256, 1, 4, 8, 0), (128, 64, 1, 4, 4, 0),
        (256, 64, 1, 4, 8, 0), (64, 128, 2, 4, 4, 0), (64, 64, 2, 5, 4, 0), (64, 64, 1, 4, 4, 0),
        (128, 128, 2, 3, 8, 1), (128, 256, 2, 3, 8, 1), (256, 128, 2, 3, 8, 1), (128, 128, 4, 3, 8, 1),
        (128, 256, 1, 4, 8, 1), (64, 256, 2, 4, 4, 1),
    )  # fmt: skip
    return [
        triton.Config(
            {"BLOCK_M": bm, "BLOCK_N": bn, "SUB_K": sk, "GROUP_M": 8, "DEQUANT": dq}, num_stages=st, num_warps=w
        )
        for bm, bn, sk, st, w, dq in shapes
        if dq or fp8_accumulation
    ]


@triton.jit
def _load_slice(a_rows, b_cols, k0, j: tl.constexpr, K, EVEN_K: tl.constexpr):
    """The A [BLOCK_M, 32] and B [32, BLOCK_N] fp8 tiles of 32-wide K slice ``k0 / 32 + j``."""
    kk = k0 + j * 32 + tl.arange(0, 32)
    if EVEN_K:
        return tl.load(a_rows + kk[None, :]), tl.load(b_cols + kk[:, None])
    a = tl.load(a_rows + kk[None, :], mask=kk[None, :] < K, other=0.0)
    b = tl.load(b_cols + kk[:, None], mask=kk[:, None] < K, other=0.0)
    return a, b


@triton.jit
def _load_scales(sa_t, sb_t, kb, rm, rn, M, N, KB):
    """float32 scales of slice ``kb`` for the tile's rows of A and columns of B (1 past the end)."""
    ok = kb < KB  # kb * M stays far below 2**31: sa_t has 1/32 of A's elements
    sa = tl.load(sa_t + kb * M + rm, mask=ok, other=1.0)
    sb = tl.load(sb_t + kb * N + rn, mask=ok, other=1.0)
    return sa, sb


@triton.jit
def _mx_gemm_kernel(
    a_ptr, b_ptr, sa_t, sb_t, c_ptr, bias_ptr,
    M, N, K, KB, stride_am, stride_bn, stride_cm,
    M_BUCKET, K_BUCKET,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUB_K: tl.constexpr, GROUP_M: tl.constexpr,
    DEQUANT: tl.constexpr = 0, F32_DOT: tl.constexpr = False,
):  # fmt: skip
    # M_BUCKET and K_BUCKET only key the autotuner (token counts change every step).
    # sa_t [KB, M] and sb_t [KB, N] are the decoded float32 block scales, K-block-major, so that a
    # K slice's scales for the tile are one contiguous, coalesced load.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    # Out-of-range rows/columns wrap around instead of being masked; their results are not stored.
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    a_rows = a_ptr + rm[:, None].to(tl.int64) * stride_am
    b_cols = b_ptr + rn[None, :].to(tl.int64) * stride_bn

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if DEQUANT:
        # Each 32-wide slice of A and B times its scales, as bfloat16 (exact: 3 mantissa bits times
        # a power of two), into one bf16 wgmma chain accumulating in float32 across all of K.
        for k0 in range(0, K, 32 * SUB_K):
            for j in tl.static_range(SUB_K):
                a, b = _load_slice(a_rows, b_cols, k0, j, K, EVEN_K)
                sa, sb = _load_scales(sa_t, sb_t, k0 // 32 + j, rm, rn, M, N, KB)
                a32 = a.to(tl.float32) * sa[:, None]
                b32 = b.to(tl.float32) * sb[None, :]
                if F32_DOT:  # the interpreter (triton 3.7) multiplies bf16 dot operands as raw bits
                    acc = tl.dot(a32, b32, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a32.to(tl.bfloat16), b32.to(tl.bfloat16), acc)
    else:
        # The scale loads are not pipelined by the compiler (they feed no dot), so each step loads the
        # next step's scales into registers while it computes (a software double buffer).
        sa0, sb0 = _load_scales(sa_t, sb_t, 0, rm, rn, M, N, KB)
        if SUB_K == 2:
            sa1, sb1 = _load_scales(sa_t, sb_t, 1, rm, rn, M, N, KB)
        for k0 in range(0, K, 32 * SUB_K):
            a, b = _load_slice(a_rows, b_cols, k0, 0, K, EVEN_K)
            p0 = tl.dot(a, b)
            if SUB_K == 2:
                a, b = _load_slice(a_rows, b_cols, k0, 1, K, EVEN_K)
                p1 = tl.dot(a, b)
            next_kb = k0 // 32 + SUB_K
            nsa0, nsb0 = _load_scales(sa_t, sb_t, next_kb, rm, rn, M, N, KB)
            # fold: acc += p * (scale_a x scale_b), as one multiply and one FMA per element
            acc = tl.fma(p0 * sa0[:, None], sb0[None, :], acc)
            sa0, sb0 = nsa0, nsb0
            if SUB_K == 2:
                nsa1, nsb1 = _load_scales(sa_t, sb_t, next_kb + 1, rm, rn, M, N, KB)
                acc = tl.fma(p1 * sa1[:, None], sb1[None, :], acc)
                sa1, sb1 = nsa1, nsb1

    _store_tile(acc, c_ptr, bias_ptr, pid_m, pid_n, rn, M, N, stride_cm, HAS_BIAS, BLOCK_M, BLOCK_N)


@triton.jit
def _store_tile(
    acc, c_ptr, bias_ptr, pid_m, pid_n, rn, M, N, stride_cm,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
    cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c = c_ptr + cm[:, None].to(tl.int64) * stride_cm + cn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(cm < M)[:, None] & (cn < N)[None, :])


_heuristics = triton.heuristics({"EVEN_K": lambda args: args["K"] % (32 * args["SUB_K"]) == 0})
_mx_gemm_fixed = _heuristics(_mx_gemm_kernel)
# default: the bf16-dequant configs only, whose float32 accumulation meets the 1e-5 contract (5e-7
# measured on the H200); `fp8_accumulation=True` also tunes the fp8-fold configs (8 % faster at
# 8192^3 there, but the fp8 wgmma's shortened accumulation gave a 4.5e-5 relative error)
_mx_gemm_tuned = triton.autotune(configs=_configs(False), key=["M_BUCKET", "N", "K_BUCKET"])(
    _heuristics(_mx_gemm_kernel)
)
_mx_gemm_tuned_fp8_acc = triton.autotune(configs=_configs(True), key=["M_BUCKET", "N", "K_BUCKET"])(
    _heuristics(_mx_gemm_kernel)
)


def decoded_scales_t(scale: torch.Tensor) -> torch.Tensor:
    """e8m0 ``[rows, KB]`` -> float32 ``[KB, rows]`` (2**(e - 127); NaN for 0xFF), the GEMM's layout.

    1/32 of the operand's elements: a small pass next to the GEMM, like cuBLAS's own scale layout.
    """
    return scale.view(torch.float8_e8m0fnu).to(torch.float32).t().contiguous()


def _bucket(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def _check_operands(a: MXTensor, b: MXTensor, where: str) -> tuple[int, int, int]:
    (m, k), (n, kb) = a.shape, b.shape
    if k != kb:
        raise ValueError(f"{where}: reduction dims differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} (C = a @ b.T)")
    for name, t in (("a.data", a.data), ("b.data", b.data), ("a.scale", a.scale), ("b.scale", b.scale)):
        if t.stride(-1) != 1:
            raise ValueError(f"{where}: {name} must have a contiguous last dim, got strides {t.stride()}")
    return m, n, k


def mx_gemm_triton(
    a: MXTensor,
    b: MXTensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    fp8_accumulation: bool = False,
) -> torch.Tensor:
    """``dequant(a) @ dequant(b).T (+ bias)`` as ``out_dtype``, by the Triton kernel.

    The autotuner picks among the bf16-dequant configs (float32 accumulation: equal to the
    reference up to accumulation order); ``fp8_accumulation=True`` adds the fp8-fold configs, whose
    fp8 MMAs accumulate each 32-wide slice with fewer mantissa bits on Hopper.

    ``config`` (keys BLOCK_M, BLOCK_N, SUB_K (1 or 2; 1, 2 or 4 with DEQUANT), GROUP_M, num_warps,
    num_stages, optional DEQUANT 0/1) bypasses the autotuner; under the interpreter a small fixed
    config is used.
    """
    check_triton_device(a.data, "mx_gemm_triton")
    m, n, k = _check_operands(a, b, "mx_gemm_triton")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"mx_gemm_triton: bias must have shape ({n},), got {tuple(bias.shape)}")
    c = torch.empty((m, n), dtype=out_dtype, device=a.data.device)
    if m == 0 or n == 0:
        return c
    if k == 0:
        return c.zero_() if bias is None else c.copy_(bias.expand(m, n))
    if config is not None and config.get("SUB_K") not in ((1, 2, 4) if config.get("DEQUANT") else (1, 2)):
        raise ValueError(f"mx_gemm_triton: config SUB_K must be 1 or 2 (1, 2 or 4 with DEQUANT), got {config}")
    if config is None and interpreting():
        config = {"BLOCK_M": 32, "BLOCK_N": 32, "SUB_K": 2, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
    kb = a.scale.shape[1]
    args = (
        a.data, b.data, decoded_scales_t(a.scale), decoded_scales_t(b.scale), c,
        bias if bias is not None else c,
        m, n, k, kb, a.data.stride(0), b.data.stride(0), c.stride(0),
        _bucket(m), _bucket(k),
    )  # fmt: skip
    if config is None:

        def grid(meta: dict[str, int]) -> tuple[int]:
            return (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)

        tuned = _mx_gemm_tuned_fp8_acc if fp8_accumulation else _mx_gemm_tuned
        tuned[grid](*args, HAS_BIAS=bias is not None, F32_DOT=interpreting())
    else:
        meta = dict(config)
        grid = (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)
        _mx_gemm_fixed[grid](*args, HAS_BIAS=bias is not None, F32_DOT=interpreting(), **meta)
    return c


# ------------------------------------------------------------------------------------ native cuBLAS


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """Rearrange a ``[rows, k/32]`` scale matrix into cuBLAS's block-scaling layout (128x4 tiles,
    each stored as 32x16), zero-padding to whole tiles; returns a flat tensor."""
    rows, cols = scale.shape
    n_row_blocks, n_col_blocks = -(-rows // 128), -(-cols // 4)
    padded = scale.view(torch.uint8)
    if (rows, cols) != (n_row_blocks * 128, n_col_blocks * 4):
        padded = torch.zeros((n_row_blocks * 128, n_col_blocks * 4), dtype=torch.uint8, device=scale.device)
        padded[:rows, :cols] = scale.view(torch.uint8)
    blocks = padded.view(n_row_blocks, 128, n_col_blocks, 4).permute(0, 2, 1, 3)
    rearranged = blocks.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1, 32, 16)
    return rearranged.flatten().view(scale.dtype)


def native_mx_shape_problem(m: int, n: int, k: int) -> str | None:
    """Why cuBLAS block-scaled MXFP8 cannot take this shape, or None when it can."""
    if k % MX_BLOCK:
        return f"K={k} is not a multiple of {MX_BLOCK}"
    if m % 16 or n % 16:
        return f"M={m} and N={n} must be multiples of 16"
    return None


def mx_gemm_native(
    a: MXTensor, b: MXTensor, *, out_dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``torch._scaled_mm`` with e8m0 block scales (needs CUDA capability >= 10.0)."""
    m, n, k = _check_operands(a, b, "mx_gemm_native")
    problem = native_mx_shape_problem(m, n, k)
    if problem:
        raise ValueError(f"mx_gemm_native: {problem}")
    out = torch._scaled_mm(
        a.data, b.data.t(), scale_a=to_blocked(a.scale), scale_b=to_blocked(b.scale), out_dtype=out_dtype
    )
    return out if bias is None else out + bias.to(out_dtype)


@functools.cache
def native_mx_probe(device_index: int) -> str | None:
    """Run one small block-scaled ``_scaled_mm`` on the device and compare it with the reference.

    Returns None when it works, else why not. Cached per device: it runs once per process.
    """
    from gem_precision.mx_reference import mx_gemm_reference, mx_quantize

    device = torch.device("cuda", device_index)
    if torch.cuda.get_device_capability(device) < (10, 0):
        return f"CUDA capability {torch.cuda.get_device_capability(device)} < (10, 0)"
    gen = torch.Generator().manual_seed(0)
    qa, qb = (
        MXTensor(*(t.to(device) for t in mx_quantize(torch.randn(128, 128, generator=gen)).tensors())) for _ in range(2)
    )
    try:
        got = mx_gemm_native(qa, qb, out_dtype=torch.float32)
    except Exception as exc:  # the probe reports why; callers decide (native raises, auto records it)
        return f"torch._scaled_mm with e8m0 block scales failed: {type(exc).__name__}: {exc}"
    want = mx_gemm_reference(qa, qb)
    err = ((got - want).norm() / want.norm()).item()
    return None if err < 1e-5 else f"block-scaled torch._scaled_mm disagrees with the reference (rel err {err:.2e})"
