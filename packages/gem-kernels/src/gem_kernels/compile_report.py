"""Compile the attention kernels for a GPU architecture on any machine, and report their resources.

Triton compiles to PTX and cubin without a GPU. This catches what the interpreter never runs (inline
PTX, layouts, shared-memory limits) and shows registers, spills and shared memory per configuration,
which is how the autotuning configurations were chosen::

    TRITON_INTERPRET=0 python -m gem_kernels.compile_report --arch 90 [--all-configs] [--fp8]

Uses ``triton.compiler.ASTSource`` (present in triton 3.6 and 3.7); argument hints mirror what
``triton.jit`` derives at launch (16-byte aligned pointers, strides divisible by 16).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from typing import Any, NamedTuple

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from gem_kernels import attention_triton, attention_triton_bias, attention_triton_bwd
from gem_kernels.attention_gluon import REGISTER_FILE
from gem_kernels.attention_triton_common import CHUNK, INTERPRET, dim_block

KERNELS = ("forward", "dq", "dkdv", "dkdv_atomic")
TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class Variant:
    kernel: str
    dtype: str = "bfloat16"
    dim_qk: int = 128
    dim_v: int = 128
    targets: bool = True
    window: bool = False
    position_bias: bool = False
    time_bias: bool = False
    """With a bias, the dk/dv kernels also accumulate its gradient."""
    fp8: bool = False
    """The forward's e4m3 ``q k^T`` (:mod:`gem_kernels.attention_fp8`): q, k in e4m3, their scales in ``DO``."""
    tma: bool = False
    """The inner loop's tiles by tensor descriptors (``attention_triton_common.tma_loads``)."""


def configs(kernel: str, wide: bool) -> list[tuple[int, int, int, int, int]]:
    if kernel in ("forward", "dq"):
        if wide:
            return attention_triton.WIDE_CONFIGS
        return attention_triton.DQ_CONFIGS if kernel == "dq" else attention_triton.FORWARD_CONFIGS
    return attention_triton_bwd.WIDE_CONFIGS if wide else attention_triton_bwd.CONFIGS


def _signature(fn: Any, pointers: dict[str, str], floats: tuple[str, ...]) -> dict[str, str]:
    return {n: pointers.get(n) or ("fp32" if n in floats else "i32") for n in fn.arg_names}


def compile_variant(variant: Variant, config: tuple[int, int, int, int, int], arch: int = 90) -> dict[str, Any]:
    """Compile one kernel variant with one (BLOCK_M, BLOCK_N, warps, stages, programs/SM) config."""
    block_m, block_n, warps, stages, per_sm = config
    t = TYPES[variant.dtype]
    common = dict(
        HAS_TARGETS=variant.targets, HAS_WINDOW=variant.window, SILU=0 if t == "fp32" else 2, IEEE=t == "fp32",
        INTERP=False, CHUNK=CHUNK, BLOCK_M=block_m, BLOCK_N=block_n, PROGRAMS_PER_SM=per_sm,
        BLOCK_DQK=dim_block(variant.dim_qk), HAS_POS_BIAS=variant.position_bias, HAS_TIME_BIAS=variant.time_bias,
    )
    offsets = {"SEQ_OFFSETS": "*i64", "NUM_TARGETS": "*i64", "COUNTER": "*i32", "PB": "*fp32", "TB": "*fp32",
               "EDGES": "*i64", "TS": "*i64", "QTS": "*i64"}
    if variant.kernel in ("forward", "dq"):
        fn = attention_triton.query_major_kernel
        dim_out = variant.dim_qk if variant.kernel == "dq" else variant.dim_v
        if variant.fp8 and variant.kernel != "forward":
            raise ValueError(f"fp8 is a mode of the forward only, not of {variant.kernel}")
        constants = dict(
            DQK=variant.dim_qk, DV=variant.dim_v, D_OUT=dim_out, BLOCK_DV=dim_block(variant.dim_v),
            BLOCK_OUT=dim_block(dim_out), COMPUTE_DQ=variant.kernel == "dq", FP8=variant.fp8, TMA=variant.tma,
            **common,
        )
        pointers = {n: "*" + t for n in ("Q", "K", "V", "DO", "OUT")} | offsets
        if variant.fp8:
            pointers |= {"Q": "*fp8e4nv", "K": "*fp8e4nv", "DO": "*fp32"}
        signature = _signature(fn, pointers, ("alpha", "out_scale"))
    else:
        fn = attention_triton_bwd.key_major_kernel
        constants = dict(
            DQK=variant.dim_qk, DV_DIM=variant.dim_v, BLOCK_DV=dim_block(variant.dim_v),
            ATOMIC_DQ=variant.kernel == "dkdv_atomic",
            DQ_T=variant.kernel == "dkdv_atomic" and attention_triton_bwd.TRANSPOSED_DQ,  # as key_major sets it
            POS_GRAD=variant.position_bias, TIME_GRAD=variant.time_bias,
            POS_STRIPES=attention_triton_bias.POSITION_STRIPES, TIME_STRIPES=attention_triton_bias.TIME_STRIPES,
            TMA=variant.tma, STORE_DS=False, **common,
        )
        pointers = ({n: "*" + t for n in ("Q", "K", "V", "DO", "DK", "DV", "DS")}
                    | {"DQ": "*fp32", "DPB": "*fp32", "DTB": "*fp32", "DS_BASE": "*i64"} | offsets)
        signature = _signature(fn, pointers, ("alpha", "max_seq_len"))
    return {"variant": variant, "config": config, **compile_kernel(fn, signature, constants, warps, stages, arch)}


def compile_kernel(fn: Any, signature: dict[str, str], constants: dict[str, Any], warps: int, stages: int = 3,
                   arch: int = 90, divisible: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    """Compile one ``triton.jit`` function: ``signature`` gives each non-constexpr argument's type
    (``*bf16``, ``i32``, ...), ``constants`` the constexprs; pointers, strides and the integer arguments
    named in ``divisible`` are taken as multiples of 16, as the JIT specializes them when they are. Shared
    bytes, registers, spill stack, and whether an fp8 cast lowered to the hardware's round-to-nearest-even
    (``cvt.rn.satfinite``), whether an MMA takes e4m3 operands, whether tiles load by bulk tensor copies
    (TMA), the CTA barriers (``bar.sync``) and the global loads and stores narrower than 4 bytes
    (``.b8``, ``.b16``: not vectorized) in its PTX."""
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    hints = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name].startswith("*") or name.startswith("stride") or name in divisible
    }
    source = ASTSource(fn, signature, constants, hints)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, "num_stages": stages})
    ptx = compiled.asm["ptx"]
    return {"shared_bytes": compiled.metadata.shared, "rne_fp8_cast": "cvt.rn.satfinite" in ptx,
            "fp8_mma": ".e4m3.e4m3" in ptx, "tma_loads": "cp.async.bulk.tensor" in ptx,
            "barriers": ptx.count("bar.sync"), **_narrow_accesses(ptx), **cubin_usage(compiled.asm["cubin"])}


def compile_producer(kernel: str, *, quantize: bool, column_amax: bool, keep_x: bool = False, words: bool = False,
                     dim: int = 1024, arch: int = 90) -> dict[str, Any]:  # fmt: skip
    """Compile the layer norm (``norm``) or norm-gate (``norm_gate``) forward of the fused HSTU block for
    ``[*, dim]`` bf16 rows, optionally writing their e4m3 rows (and column maxima), as the block launches it;
    ``keep_x``: the norm-gate also writes its input's e4m3 rows (``fp8_saved``'s attention output);
    ``words``: the norm-gate stores its rows as 16-bit words (``norm_gate_triton.E4M3_WORD_STORES``)."""
    from gem_kernels import layer_norm_triton, norm_gate_triton
    from gem_kernels.quantized_rows_triton import ROWS_PER_PROGRAM_WITH_COLUMNS

    block_d = triton.next_power_of_2(dim)
    pointers = {"X": "*bf16", "Y": "*bf16", "MEAN": "*fp32", "RSTD": "*fp32", "Q": "*u8", "Q_INV": "*fp32",
                "COL_AMAX": "*i32" if column_amax else "*fp32"}  # fmt: skip
    if kernel == "norm":
        fn, rows, warps = layer_norm_triton._norm_fwd, *layer_norm_triton._launch_shape(
            dim, e4m3_rows=quantize and not column_amax)[1:]
        constants: dict[str, Any] = {"STAGES": None}
    else:
        fn, rows = norm_gate_triton._norm_gate_fwd, norm_gate_triton._rows_per_tile(block_d)
        warps = 4 if block_d < 2048 else 8  # as NormGateFunction.run_forward launches it
        pointers |= {"U": "*bf16", "W": "*fp32", "B": "*fp32", "XQ": "*u8", "XQ_INV": "*fp32"}
        if words:
            pointers |= {"Q": "*i16", "XQ": "*i16"}
        constants = {"SILU_GATE": True, "STAGES": norm_gate_triton.PIPELINE_STAGES, "KEEP_X": keep_x, "WORDS": words}
    tiles = -(-ROWS_PER_PROGRAM_WITH_COLUMNS // rows) if column_amax else 1
    constants |= dict(D=dim, BLOCK_D=block_d, ROWS=rows, TILES=tiles, QUANT=quantize, COLUMN_AMAX=column_amax,
                      INTERP=False)  # fmt: skip
    signature = _signature(fn, pointers, ("eps",)) | {name: "constexpr" for name in constants}
    # pointers and row strides as the JIT sees them at d = 1024 (multiples of 16): without the strides' hint
    # every load and store of a row went 2 bytes at a time in this build, not in the launched one
    hints = {
        (i,): [["tt.divisibility", 16]]
        for i, name in enumerate(fn.arg_names)
        if signature[name].startswith("*") or name.startswith("stride")
    }
    compiled = triton.compile(ASTSource(fn, signature, constants, hints), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps})  # fmt: skip
    ptx = compiled.asm["ptx"]
    return {"kernel": kernel, "shared_bytes": compiled.metadata.shared, "barriers": ptx.count("bar.sync"),
            **_narrow_accesses(ptx), **cubin_usage(compiled.asm["cubin"])}


class GluonBuild(NamedTuple):
    """One compiled Gluon attention kernel (``compiled.asm`` holds its ``ptx`` and ``cubin``) and its launch."""

    compiled: Any
    warps: int
    programs_per_sm: int
    register_cap: int | None


def build_gluon(config: str, dim_qk: int = 128, dim_v: int = 128, *, targets: bool = True, arch: int = 90,
                dq: bool = False, dkdv: bool = False, store_ds: bool = False) -> GluonBuild:  # fmt: skip
    """Compile one Gluon attention kernel as :func:`compile_gluon_forward` describes, and hand it back."""
    import torch
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from gem_kernels import attention_gluon as ag
    from gem_kernels import attention_gluon_dkdv as dkdv_pass
    from gem_kernels import attention_gluon_dq as dq_pass
    from gem_kernels import attention_gluon_fwd as fwd
    from gem_kernels import attention_gluon_ws as ws

    block_m, block_n, warps, stages, per_sm = (ag.DKDV_CONFIGS if dkdv else ag.CONFIGS)[config]

    def descriptor(rows: int, dim: int) -> str:  # the JIT's type string of a host descriptor, from a CPU tensor
        return mangle_type(ag.row_view_descriptor(torch.empty(16, 2, dim, dtype=torch.bfloat16), rows))

    specialized = config.startswith("ws_")
    fn = (dkdv_pass.dkdv_ws_kernel if specialized else dkdv_pass.dkdv_kernel) if dkdv else (
        (dq_pass.dq_ws_kernel if specialized else dq_pass.dq_kernel) if dq
        else (ws.forward_ws_kernel if specialized else fwd.forward_kernel))
    types = {"q_desc": descriptor(block_m, dim_qk), "do_desc": descriptor(block_m, dim_v),
             "k_desc": descriptor(block_n, dim_qk), "v_desc": descriptor(block_n, dim_v), "OUT": "*bf16", "DQ": "*bf16",
             "DK": "*bf16", "DV": "*bf16", "dk_scale": "fp32", "dv_scale": "fp32",
             "SEQ_OFFSETS": "*i64", "NUM_TARGETS": "*i64", "COUNTER": "*i32", "half_alpha": "fp32",
             "out_scale": "fp32", "DS_BASE": "*i64",
             "ds_desc": mangle_type(ag.stored_descriptor(torch.empty(64, 64, dtype=torch.bfloat16)))}  # fmt: skip
    constants = dict(HAS_TARGETS=targets, CHUNK=ag.CHUNK, BLOCK_M=block_m, BLOCK_N=block_n, DQK=dim_qk,
                     STAGES=stages, **({"DVD": dim_v} if dkdv else {"DV": dim_v}),
                     **({"PRODUCER_REGS": ag.PRODUCER_REGISTERS} if specialized else {}),
                     **({"STORE_DS": store_ds} if fn is dkdv_pass.dkdv_kernel else {}),
                     **({"QUERY_REGS": config.startswith("qr_")} if fn is fwd.forward_kernel else {}))  # fmt: skip
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in fn.arg_names}
    hints = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if signature[n].startswith("*") or n.startswith("stride")}  # fmt: skip
    cap = ag.register_cap(warps, per_sm)
    compiled = triton.compile(GluonASTSource(fn, signature, constants, hints), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": warps, **({"maxnreg": cap} if cap else {})})  # fmt: skip
    return GluonBuild(compiled, warps, per_sm, cap)


def compile_gluon_forward(config: str, dim_qk: int = 128, dim_v: int = 128, *, targets: bool = True,
                          arch: int = 90, dq: bool = False, dkdv: bool = False,
                          store_ds: bool = False) -> dict[str, Any]:  # fmt: skip
    """Compile :mod:`gem_kernels.attention_gluon`'s forward (``config`` one of its ``CONFIGS``; with ``dq``
    the ``dq`` pass of :mod:`~gem_kernels.attention_gluon_dq`, with ``dkdv`` the ``dk``/``dv`` pass of
    :mod:`~gem_kernels.attention_gluon_dkdv`, ``config`` one of ``DKDV_CONFIGS``, with ``store_ds`` writing
    its ``ds`` tiles for :mod:`~gem_kernels.attention_stored`) for ``arch`` with bf16
    inputs, as :mod:`~gem_kernels.attention_gluon` launches it: shared bytes,
    registers, spill stack, CTA barriers and, per loop iteration's instructions, the asynchronous MMAs
    (``wgmma.mma_async``), their waits (``wgmma.wait_group N``, by N), bulk tensor copies,
    ``tanh.approx`` (the silu) and the register counts the warp-specialized builds set (``setmaxnreg``)."""
    compiled, warps, per_sm, cap = build_gluon(config, dim_qk, dim_v, targets=targets, arch=arch, dq=dq,
                                               dkdv=dkdv, store_ds=store_ds)  # fmt: skip
    ptx = compiled.asm["ptx"]
    usage = cubin_usage(compiled.asm["cubin"])
    waits = {int(n): ptx.count(f"wgmma.wait_group.sync.aligned {n};") for n in set(re.findall(r"wgmma.wait_group.sync.aligned (\d+);", ptx))}
    return {"shared_bytes": compiled.metadata.shared, "barriers": ptx.count("bar.sync"),
            "mma_order": _mma_order(ptx), "arrives_after_barrier": _arrives_after_barrier(ptx),
            "async_mmas": ptx.count("wgmma.mma_async"), "mma_waits": waits,
            "tma_loads": ptx.count("cp.async.bulk.tensor"), "tanh_approx": "tanh.approx.f32" in ptx,
            "setmaxnreg": sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)}),
            "register_cap": cap, "programs_per_sm": per_sm,
            "fit_per_sm": programs_fitting(usage["registers"], compiled.metadata.shared, warps, arch),
            **_narrow_accesses(ptx), **usage}  # fmt: skip


SHARED_PER_SM = {90: 228 * 1024}
"""Shared memory an SM has, by architecture; each resident program also takes 1 KiB the runtime keeps."""


def programs_fitting(registers: int | None, shared_bytes: int, warps: int, arch: int = 90) -> int | None:
    """How many programs of ``warps`` warps, ``registers`` a thread (allocated 8 at a time) and
    ``shared_bytes`` fit one SM of ``arch`` at once, by registers and shared memory (at most 64 warps);
    ``None`` where the registers are not known."""
    if registers is None or arch not in SHARED_PER_SM:
        return None
    by_registers = REGISTER_FILE // (warps * 32 * -(-registers // 8) * 8)
    return min(by_registers, SHARED_PER_SM[arch] // (shared_bytes + 1024), 64 // warps)


def _mma_order(ptx: str) -> list[str]:
    """The ``wgmma`` commit groups and waits in the PTX's text order: ``"64x64"`` for a group of
    ``m64n64`` instructions, ``"wait1"`` for ``wgmma.wait_group 1``, and ``"store"`` for a bulk tensor store
    from shared memory. The partial wait of a loop follows the groups it leaves in flight, so the order
    shows which group a wait lets through, and what a store runs beside."""
    order: list[str] = []
    shape = None
    for line in ptx.splitlines():
        found = re.search(r"wgmma\.mma_async\.sync\.aligned\.m(\d+)n(\d+)k\d+", line)
        if found:
            shape = f"{found[1]}x{found[2]}"
        elif "wgmma.commit_group" in line and shape is not None:
            order.append(shape)
            shape = None
        elif "wgmma.wait_group" in line:
            order.append("wait" + line.split()[-1].rstrip(";"))
        elif "cp.async.bulk.tensor" in line and ".global.shared" in line:
            order.append("store")
    return order


def follows(order: list[str], run: list[str]) -> bool:
    """Whether ``run`` appears in ``order`` (a build's ``mma_order``) as consecutive entries."""
    return any(order[i:i + len(run)] == run for i in range(len(order)))


def _arrives_after_barrier(ptx: str) -> bool:
    """Whether every plain ``mbarrier.arrive`` (one elected thread's) follows a barrier of its warps
    within a few instructions: with two warpgroups, the other one's MMAs must be done before the slot
    is handed back."""
    lines = ptx.splitlines()
    arrives = [i for i, line in enumerate(lines) if "mbarrier.arrive.shared" in line and "expect_tx" not in line]
    return all(any(prev.strip().startswith("bar.sync") for prev in lines[max(0, i - 6):i]) for i in arrives)


def _narrow_accesses(ptx: str) -> dict[str, int]:
    """Global loads and stores of single 1- or 2-byte values (``ld.global[.nc][.L1::...].b16``; not the
    ``.v2``/``.v4`` vectors): a tile whose accesses Triton could not vectorize."""
    return {f"narrow_{kind}s": len(re.findall(rf"{op}\.global(?:\.(?!v\d)[\w:]+)*?\.b(?:8|16)\b", ptx))
            for kind, op in (("load", "ld"), ("store", "st"))}


def bundled_tool(name: str) -> str:
    """The path of the NVIDIA tool ``name`` (``cuobjdump``, ``nvdisasm``, ``ptxas``) that the installed
    Triton ships (``triton/backends/nvidia/bin``); whether it is there is the caller's to check."""
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def run_on_cubin(command: list[str], cubin: bytes, *, check: bool = False) -> subprocess.CompletedProcess[str]:
    """``command`` (a tool and its options) run on ``cubin`` written to a temporary file, its path last;
    ``check``: raise ``CalledProcessError`` if the tool fails."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([*command, f.name], capture_output=True, text=True, check=check)


def cubin_usage(cubin: bytes) -> dict[str, int | None]:
    """A cubin's ``registers`` a thread and ``stack_bytes`` (its spill stack), by ``cuobjdump -res-usage``;
    ``None`` each where the tool printed no usage."""
    out = run_on_cubin([bundled_tool("cuobjdump"), "-res-usage"], cubin).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return {"registers": int(found[1]) if found else None, "stack_bytes": int(found[2]) if found else None}


def main() -> None:
    if INTERPRET:
        raise SystemExit("unset TRITON_INTERPRET: the interpreter replaces the kernels this would compile")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--dtype", choices=tuple(TYPES), default="bfloat16")
    parser.add_argument("--dims", type=int, nargs=2, default=(128, 128), metavar=("DQK", "DV"))
    parser.add_argument("--all-configs", action="store_true", help="every autotuning config, not just the first")
    parser.add_argument("--bias", choices=("none", "position", "time", "both"), default="none")
    parser.add_argument("--fp8", action="store_true", help="the forward's e4m3 q k^T mode (forward only)")
    parser.add_argument("--tma", action="store_true", help="the kernels' tensor-descriptor loads")
    args = parser.parse_args()
    for kernel in ("forward",) if args.fp8 else KERNELS:
        variant = Variant(kernel, args.dtype, *args.dims, position_bias=args.bias in ("position", "both"),
                          time_bias=args.bias in ("time", "both"), fp8=args.fp8,
                          tma=args.tma)
        table = configs(kernel, max(args.dims) > 128)
        for config in table if args.all_configs else table[:1]:
            r = compile_variant(variant, config, args.arch)
            print(f"{kernel:<12} {config}  registers={r['registers']} spill_stack={r['stack_bytes']}B "
                  f"shared={r['shared_bytes'] // 1024}KiB")


if __name__ == "__main__":
    main()
