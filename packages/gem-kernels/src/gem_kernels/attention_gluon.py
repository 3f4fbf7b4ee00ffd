"""Jagged HSTU attention for Hopper (sm_90) in Gluon: the switches, configs and launchers of the
forward, the ``dq`` pass and the ``dk``/``dv`` pass, whose kernels keep the tensor cores busy while the
silu runs.

Same operation as :mod:`gem_kernels.attention_triton` (no relative bias, no window)::

    out[i, h] = sum_j mask(i, j) * silu(alpha * <q[i, h], k[j, h]>) / N * v[j, h]

Why second kernels. On the H200 the Triton kernels keep the tensor pipe busy about half of their
cycles (Nsight, 2026-12-04): they wait for each ``q k^T`` before its silu, and Triton 3.6 does not
generate a producer / consumer split for Hopper. Gluon (Triton's lower-level language) writes the
schedule by hand, FlashAttention-3's way:

* the streamed tiles (k and v; q and g in the dk/dv pass) come by TMA into a ring of ``STAGES``
  shared-memory slots, each with an mbarrier; a slot is reloaded as soon as the MMAs that read it
  have retired;
* each step issues its score MMAs (``S_i = q k_i^T``; with ``dP_i = g v_i^T`` in the backward) and the
  previous step's accumulating MMAs as asynchronous warpgroup MMAs, waits for the scores only, and
  computes the silu (one ``tanh.approx`` per score, as the Triton kernels) while the tensor cores run
  the others;
* the accumulating MMAs' left operands (``P``, ``ds``) go from registers.

Modules: :mod:`~gem_kernels.attention_gluon_fwd` (the forward; its ``qr_*`` configs hold each tile's
queries in registers), :mod:`~gem_kernels.attention_gluon_ws`
(the forward with its loads in a producer warp: the ``ws_*`` configs),
:mod:`~gem_kernels.attention_gluon_dq`, :mod:`~gem_kernels.attention_gluon_dkdv` (with its own ``ws_*``
kernel), :mod:`~gem_kernels.attention_gluon_common` (what they share). Tiles and their order are the
Triton kernels': (sequence, head, block) claimed from a queue by a persistent grid (dealt statically to
the ``ws_*`` kernels' two partitions); blocks wholly inside the mask run without mask math.

What they do not do (the Triton kernels do): relative biases, ``max_attn_len``, fp8 inputs, atomic
``dq``, head dims other than 64 and 128, and any GPU other than sm_90. (A ``dk``/``dv`` pass that adds ``dq``
itself, a fifth MMA a step and one bulk tensor reduction a tile, was built and measured on the H100 on
2026-12-06: 1.22-1.38x the energy of the shipped backward, which recomputes ``q k^T`` and ``g v^T`` in
its ``dq`` pass; removed, recoverable from 9d480e6. ``benchmarks/results/e2e_ab.md`` has the table.) :func:`supported` says whether
a call qualifies. ``query_major`` and ``key_major`` route there when :data:`FORWARD`, :data:`DQ` or
:data:`DKDV` is on. The kernels are compiled for sm_90 on the CPU and checked there; their numbers on
the GPU are ``benchmarks/attention_gluon.py``'s (``benchmarks/results/jagged_attention.md``). On the H200
(2026-12-05) the dk/dv pass at two programs an SM (``n64m32``) is faster than the Triton one, and
:data:`DKDV` is on; the forward and the ``dq`` pass are not (their switches stay off).
"""

from __future__ import annotations

from typing import Any

import torch

# Gluon and the kernels are imported where a call needs them, not here: ``attention_triton`` imports this
# module for its switches, and defining the Gluon kernels costs ~0.1 s at every start.

FORWARD = False
"""Route qualifying forward calls of ``query_major`` here (read at call time)."""
DQ = False
"""Route qualifying ``dq`` passes of ``query_major`` to :mod:`gem_kernels.attention_gluon_dq` (read at
call time)."""
DKDV = True
"""Route qualifying ``key_major`` calls (no atomic ``dq``, no bias) to :mod:`gem_kernels.attention_gluon_dkdv`
(read at call time). On since 2026-12-05: on the H200 the pass is 1.182x the Triton one at the big
config's lengths and 1.105x at 1,024 (``benchmarks/attention_gluon.py``), and the big config's step
1.021x (IQR 1.013-1.032) over 60 batches (``benchmarks/e2e_ab.py``; e2e switch ``triton_dkdv`` turns it off)."""

CONFIGS: dict[str, tuple[int, int, int, int, int]] = {
    # name: (BLOCK_M, BLOCK_N, num_warps, STAGES, programs per SM). 8 warps = two warpgroups of 64 query
    # rows each. Shared memory (sm_90 build): m128n64 128 KiB, m64n64 ~80 KiB (two programs fit an SM's
    # 228 KiB); the n128 tiles take all 255 registers and spill 8 bytes.
    "m128n64": (128, 64, 8, 3, 1),
    "m64n64": (64, 64, 4, 2, 2),
    "m128n128": (128, 128, 8, 2, 1),
    "m64n128": (64, 128, 4, 2, 1),
    # three programs an SM, as the Triton forward's best (64 x 32, 3 stages): 64 KiB of shared memory
    # each, registers capped at 168 (register_cap). The forward takes ~135 (the 2-stage ring 138, the
    # queries in registers, qr_*, ~165); the dq pass 2 stages (3 would take 80 KiB), capped from 182 it
    # spills 32 bytes, and 16-key blocks with 4 stages, which fit 157 without spills
    "m64n32": (64, 32, 4, 3, 3),
    "m64n32s2": (64, 32, 4, 2, 3),
    # the dq pass as the shipped dk/dv pass runs (one warpgroup, 32-wide steps, two programs an SM, no
    # register cap): 32 keys a step, 3 or 2 stages. Slower on the H100 (2026-12-06, big config): 0.904x and
    # 0.732x the Triton dq pass (m64n64 0.916x)
    "m64n32p2": (64, 32, 4, 3, 2),
    "m64n32s2p2": (64, 32, 4, 2, 2),
    "m64n16": (64, 16, 4, 4, 3),
    "qr_m64n32": (64, 32, 4, 3, 3),
    # the loads in a producer warp of their own (attention_gluon_ws): one program an SM, its consumer
    # warpgroups at 240 registers (setmaxnreg), two query slots; no spills at either key block
    "ws_m128n64": (128, 64, 8, 3, 1),
    "ws_m128n128": (128, 128, 8, 2, 1),
    "ws_m128n32": (128, 32, 8, 4, 1),  # the dq pass's (DQ_CONFIGS)
}
DQ_CONFIGS = ("m128n64", "m64n64", "m64n32s2", "m64n32p2", "m64n32s2p2", "m64n16", "ws_m128n32", "ws_m128n64")
"""The configs the ``dq`` pass takes: one partition (in the sm_90 build ``m128n64`` and ``m64n64`` take
255 registers and spill 8 bytes, the 128-wide key blocks 576; ``m64n32s2`` and ``m64n16`` run three
programs an SM), or the loads in a producer warp (``ws_*``: 32-key blocks fit the consumers' 240
registers)."""
DEFAULT_DQ_CONFIG = "m64n64"
"""The fastest on the H200 (2026-12-05): 0.947x the Triton dq pass at the big config's lengths, 0.968x at 1024."""
DKDV_CONFIGS: dict[str, tuple[int, int, int, int, int]] = {
    # name: (BLOCK_M queries a step, BLOCK_N keys a tile, num_warps, STAGES, programs per SM):
    # two warpgroups of 64 keys, dk and dv in registers. In the sm_90 build both take 255 registers;
    # 32-query steps spill 8 bytes, 64-query steps 312 (the Triton kernel's best is 32 x 128 too)
    "n128m32": (32, 128, 8, 3, 1),
    "n128m64": (64, 128, 8, 2, 1),
    # one warpgroup of 64 keys, two programs an SM (the same 8 warps an SM, in two independent programs
    # whose phases overlap, as three forward programs do): 255 registers at 32-query steps (80 KiB; no
    # spills in Triton 3.6's build, 8 bytes in 3.7's), 223 at 16-query steps (64 KiB)
    "n64m32": (32, 64, 4, 3, 2),
    "n64m16": (16, 64, 4, 4, 2),
    # the loads in a producer warp (attention_gluon_dkdv.dkdv_ws_kernel): two k/v slots; the consumer
    # warpgroups' 240 registers fit 16-query steps without spills, 32-query steps spill
    "ws_n128m16": (16, 128, 8, 4, 1),
    "ws_n128m32": (32, 128, 8, 3, 1),
}
DEFAULT_DKDV_CONFIG = "n64m32"
"""The fastest on the H200 (2026-12-05, ``benchmarks/attention_gluon.py --rounds 8``): 3.434 ms against
the Triton pass's 4.059 at the big config's lengths (1.182x; ``n128m32``, the default before, 0.868x),
2.844 against 3.144 at 1,024."""
PRODUCER_REGISTERS = 40
"""Registers of the ``ws_*`` configs' producer warp (it computes addresses and waits on barriers)."""
DEFAULT_CONFIG = "m64n64"
"""The launch used unless ``config`` says otherwise: the fastest forward on the H200 (2026-12-05), still
0.817x the Triton forward at the big config's lengths (``benchmarks/results/e2e_ab.md``)."""

CHUNK = 128
"""Sequences read per step of the queue scan (as the Triton kernel's ``CHUNK``)."""

REGISTER_FILE = 65536
"""32-bit registers an SM has (sm_90)."""


def stores_ds(config: str) -> bool:
    """Whether the ``dk``/``dv`` pass's ``config`` (one of ``DKDV_CONFIGS``) can write its ``ds`` tiles
    (``dkdv``'s ``stored``): 32-query steps of 64-key tiles in one partition, not warp-specialized."""
    return not config.startswith("ws_") and DKDV_CONFIGS[config][:2] == (32, 64)


def register_cap(warps: int, per_sm: int) -> int | None:
    """The registers a thread may take so that ``per_sm`` programs of ``warps`` warps share an SM's
    register file (allocated 8 a thread at a time), or ``None`` where the 255 a thread can address
    already fit. ``ptxas`` spills what does not fit under the cap: ``compile_report`` shows how much."""
    cap = REGISTER_FILE // (per_sm * warps * 32) // 8 * 8
    return None if cap >= 255 else cap


def _limits(warps: int, per_sm: int) -> dict[str, int]:
    """The launch options of a config besides its constants: the register cap where it needs one."""
    cap = register_cap(warps, per_sm)
    return {} if cap is None else {"maxnreg": cap}

HEAD_DIMS = (64, 128)


def shared_layout(block: list[int], dtype: torch.dtype) -> Any:
    """The NVMMA (wgmma-readable, 128-byte swizzled) shared layout of a ``block`` tile."""
    from triton.experimental.gluon import language as gl

    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *grad_out: torch.Tensor) -> bool:
    """Whether these kernels can take the forward (or with ``grad_out``, the ``dq`` pass) of these
    ``[L, H, D]`` tensors on their device."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    from gem_kernels.attention_gluon_common import HAVE_GLUON  # imports Gluon: only where it could run

    if not HAVE_GLUON:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in (k, v, *grad_out)):
        return False
    if q.shape[2] not in HEAD_DIMS or v.shape[2] not in HEAD_DIMS or k.shape[2] != q.shape[2]:
        return False
    if any(g.shape != v.shape for g in grad_out):
        return False
    for t in (q, k, v, *grad_out):  # heads side by side in a row, rows 16-byte aligned: a 2-D TMA view
        if t.stride(2) != 1 or t.stride(1) != t.shape[2] or (t.stride(0) * t.element_size()) % 16 or t.data_ptr() % 16:
            return False
    return True


def row_view_descriptor(t: torch.Tensor, block_rows: int) -> Any:
    """A host tensor descriptor over ``[L, H, D]`` seen as ``[L, H D]``, in ``[block_rows, D]`` tiles."""
    rows, heads, dim = t.shape
    block = [block_rows, dim]
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor(t, [rows, heads * dim], [t.stride(0), 1], block, shared_layout(block, t.dtype))


def stored_descriptor(buffer: torch.Tensor) -> Any:
    """A host tensor descriptor over a stored ``ds`` buffer ``[rows, 64]`` in ``[32, 64]`` tiles."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [32, 64]
    return TensorDescriptor(buffer, list(buffer.shape), [buffer.stride(0), 1], block, shared_layout(block, buffer.dtype))


def _config(kind: str, config: str | None, names: dict | tuple, default: str) -> tuple[int, int, int, int, int]:
    """The launch of config ``config`` (or ``default``) of pass ``kind``; a clear error for an unknown one."""
    name = config or default
    if name not in names:
        raise ValueError(f"attention_gluon.{kind}: config {name!r} is not one of {sorted(names)}")
    return (DKDV_CONFIGS if kind == "dkdv" else CONFIGS)[name]


def _grid(device: torch.device, per_sm: int, programs: int | None) -> tuple[int]:
    """The persistent grid: ``programs`` if given, else the config's programs per SM on every SM."""
    if programs is not None:
        if programs < 1:
            raise ValueError(f"attention_gluon: programs must be at least 1, got {programs}")
        return (programs,)
    return (torch.cuda.get_device_properties(device).multi_processor_count * per_sm,)


def _common(seq_offsets: torch.Tensor, num_targets: torch.Tensor | None, heads: int, alpha: float,
            block_m: int, block_n: int, stages: int, warps: int) -> tuple[tuple, tuple, dict]:  # fmt: skip
    """What every launch passes: the offsets and targets (the offsets stand in when there are none;
    unread); the sequence and head counts and ``alpha / 2``; and the constants they share."""
    targets = num_targets if num_targets is not None else seq_offsets
    constants = dict(HAS_TARGETS=num_targets is not None, CHUNK=CHUNK, BLOCK_M=block_m, BLOCK_N=block_n,
                     STAGES=stages, num_warps=warps)  # fmt: skip
    return (seq_offsets, targets), (seq_offsets.shape[0] - 1, heads, 0.5 * float(alpha)), constants


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    *,
    max_seq_len: int,
    alpha: float,
    out: torch.Tensor | None = None,
    config: str | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """The attention output ``[L, H, Dv]``; the caller has checked :func:`supported`. ``programs``: the
    persistent grid's size (default: the config's programs per SM times the SMs; 1 runs every tile in
    one program, one after another, which takes the races between programs out of a failing check)."""
    from gem_kernels.attention_triton_common import device_guard, queue_counter

    rows, heads, dim_qk = q.shape
    out = out if out is not None else torch.empty((rows, heads, v.shape[2]), dtype=v.dtype, device=v.device)
    name = config or DEFAULT_CONFIG
    block_m, block_n, warps, stages, per_sm = _config("forward", name, CONFIGS, DEFAULT_CONFIG)
    if rows == 0 or seq_offsets.shape[0] <= 1:
        return out
    pointers, counts, constants = _common(seq_offsets, num_targets, heads, alpha, block_m, block_n, stages, warps)
    descriptors = (row_view_descriptor(q, block_m), row_view_descriptor(k, block_n), row_view_descriptor(v, block_n))
    scalars = (out.stride(0), out.stride(1), *counts, 1.0 / max_seq_len)
    with device_guard(q.device):
        grid = _grid(q.device, per_sm, programs)
        if name.startswith("ws_"):
            from gem_kernels.attention_gluon_ws import forward_ws_kernel

            forward_ws_kernel[grid](*descriptors, out, *pointers, *scalars, DQK=dim_qk, DV=v.shape[2],
                                    PRODUCER_REGS=PRODUCER_REGISTERS, **constants)  # fmt: skip
        else:
            from gem_kernels.attention_gluon_fwd import forward_kernel

            forward_kernel[grid](*descriptors, out, *pointers, queue_counter(q.device), *scalars, DQK=dim_qk,
                                 DV=v.shape[2], QUERY_REGS=name.startswith("qr_"),
                                 **constants, **_limits(warps, per_sm))  # fmt: skip
    return out


def dq(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    *,
    max_seq_len: int,
    alpha: float,
    out: torch.Tensor | None = None,
    config: str | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """``dq`` ``[L, H, Dqk]`` of the attention (:mod:`gem_kernels.attention_gluon_dq`); the caller has
    checked :func:`supported` with ``grad_out``. ``programs`` as :func:`forward` takes it."""
    from gem_kernels.attention_triton_common import device_guard, queue_counter

    rows, heads, dim_qk = q.shape
    out = out if out is not None else torch.empty((rows, heads, dim_qk), dtype=q.dtype, device=q.device)
    block_m, block_n, warps, stages, per_sm = _config("dq", config, DQ_CONFIGS, DEFAULT_DQ_CONFIG)
    if rows == 0 or seq_offsets.shape[0] <= 1:
        return out
    from gem_kernels.attention_gluon_dq import dq_kernel, dq_ws_kernel

    pointers, counts, constants = _common(seq_offsets, num_targets, heads, alpha, block_m, block_n, stages, warps)
    descriptors = (row_view_descriptor(q, block_m), row_view_descriptor(grad_out, block_m),
                   row_view_descriptor(k, block_n), row_view_descriptor(v, block_n))  # fmt: skip
    scalars = (out.stride(0), out.stride(1), *counts, float(alpha) / max_seq_len)
    with device_guard(q.device):
        grid = _grid(q.device, per_sm, programs)
        if (config or DEFAULT_DQ_CONFIG).startswith("ws_"):
            dq_ws_kernel[grid](*descriptors, out, *pointers, *scalars, DQK=dim_qk, DV=v.shape[2],
                               PRODUCER_REGS=PRODUCER_REGISTERS, **constants)  # fmt: skip
        else:
            dq_kernel[grid](*descriptors, out, *pointers, queue_counter(q.device), *scalars, DQK=dim_qk, DV=v.shape[2],
                            **constants, **_limits(warps, per_sm))  # fmt: skip
    return out


def dkdv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    *,
    max_seq_len: int,
    alpha: float,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    config: str | None = None,
    programs: int | None = None,
    stored: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``dk``, ``dv`` of the attention (:mod:`gem_kernels.attention_gluon_dkdv`), into ``out`` if given;
    the caller has checked :func:`supported` with ``grad_out``. ``programs`` as :func:`forward` takes it.
    ``stored`` (:class:`gem_kernels.attention_stored.StoredScores`): also write every ``ds`` tile there (a
    config of 32-query steps over 64-key tiles, not warp-specialized: ``n64m32``)."""
    from gem_kernels.attention_triton_common import device_guard, queue_counter

    rows, heads, dim_qk = q.shape
    dk, dv = out if out is not None else (torch.empty_like(k, memory_format=torch.contiguous_format),
                                          torch.empty_like(v, memory_format=torch.contiguous_format))  # fmt: skip
    block_m, block_n, warps, stages, per_sm = _config("dkdv", config, DKDV_CONFIGS, DEFAULT_DKDV_CONFIG)
    name = config or DEFAULT_DKDV_CONFIG
    if stored is not None and not stores_ds(name):
        raise ValueError(f"attention_gluon.dkdv: stored ds tiles need 32-query steps of 64-key tiles in one "
                         f"partition (n64m32), not config {name!r}")  # fmt: skip
    if rows == 0 or seq_offsets.shape[0] <= 1:
        return dk, dv
    from gem_kernels.attention_gluon_dkdv import dkdv_kernel, dkdv_ws_kernel

    pointers, counts, constants = _common(seq_offsets, num_targets, heads, alpha, block_m, block_n, stages, warps)
    descriptors = (row_view_descriptor(q, block_m), row_view_descriptor(grad_out, block_m),
                   row_view_descriptor(k, block_n), row_view_descriptor(v, block_n))  # fmt: skip
    scalars = (dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1), *counts, float(alpha) / max_seq_len,
               1.0 / max_seq_len)  # fmt: skip
    with device_guard(q.device):
        grid = _grid(q.device, per_sm, programs)
        if name.startswith("ws_"):
            dkdv_ws_kernel[grid](*descriptors, dk, dv, *pointers, *scalars, DQK=dim_qk, DVD=v.shape[2],
                                 PRODUCER_REGS=PRODUCER_REGISTERS, **constants)  # fmt: skip
        else:
            # without stored tiles, q's descriptor and the offsets stand in for the unread ds arguments
            ds_desc = descriptors[0] if stored is None else stored_descriptor(stored.buffer)
            ds_base = seq_offsets if stored is None else stored.base
            dkdv_kernel[grid](*descriptors, ds_desc, dk, dv, *pointers, queue_counter(q.device), ds_base, *scalars,
                              DQK=dim_qk, DVD=v.shape[2], STORE_DS=stored is not None, **constants,
                              **_limits(warps, per_sm))  # fmt: skip
    return dk, dv
