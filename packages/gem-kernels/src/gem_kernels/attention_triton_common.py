"""Helpers shared by the jagged attention kernels: the launcher (tuning and direct launches), the
self-resetting work queue, masks, silu, dot and loads.

Imported only when a Triton kernel is used (it imports triton at module level).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import triton
import triton.language as tl
from triton import knobs

from gem_kernels.availability import interpreter_enabled

INTERPRET = interpreter_enabled()
"""Frozen at import: ``triton.jit`` decides interpreted vs compiled when this module is imported."""

SILU_EXACT, SILU_TANH, SILU_TANH_APPROX = 0, 1, 2
CHUNK = 128
"""Sequences scanned at once by the in-kernel scheduler (one vector load of offsets per chunk)."""

DIRECT_LAUNCH = os.environ.get("GEM_KERNELS_DIRECT_LAUNCH", "1").strip().lower() not in ("0", "false", "no", "off")
"""Launch cached compiled kernels without Triton's JIT dispatch (set ``GEM_KERNELS_DIRECT_LAUNCH=0`` to
always go through ``kernel[grid](...)``)."""

TUNE_WARMUP_MS, TUNE_REP_MS = 10, 50
"""``do_bench`` budgets per config when tuning (Triton's autotuner takes 25 and 100: a benchmark run
tunes some fifteen keys of up to seven configs each)."""

Config = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, num_warps, num_stages, programs per SM)."""


def silu_mode(dtype: torch.dtype) -> int:
    """fp32 keeps the exact sigmoid. 16-bit inputs use ``tanh.approx.f32`` (one MUFU op instead of an
    exp and a reciprocal; its ~2^-11 error is below bf16 rounding). The interpreter cannot run inline
    PTX, so it checks the same tanh-based algebra with an exact tanh."""
    if dtype == torch.float32:
        return SILU_EXACT
    if INTERPRET or torch.version.hip is not None:
        return SILU_TANH
    return SILU_TANH_APPROX


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


def fixed_config(block_m: int, block_n: int) -> Config:
    """Tile sizes set by hand: two warpgroups once a tile's fp32 scores would crowd one."""
    warps = 1 if INTERPRET else (8 if block_m * block_n >= 128 * 64 else 4)
    return (block_m, block_n, warps, 1 if INTERPRET else 2, 1)


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


def _int_class(value: int, specialize: bool) -> int:
    """What ``triton.jit`` specialises an int argument on: its type (i32 / i64 / u64) and, unless
    ``do_not_specialize``, whether it is 1 (a constant) or a multiple of 16."""
    wide = 0 if -(2**31) <= value < 2**31 else (8 if value >= 2**63 else 4)
    if not specialize:
        return wide
    return wide | (1 if value == 1 else (2 if value % 16 == 0 else 0))


def _spec(args: tuple, pointer_at: tuple[int, ...], int_at: tuple[tuple[int, bool], ...]) -> tuple:
    key: list[object] = []
    for i in pointer_at:
        tensor = args[i]
        key.append(tensor.dtype)
        key.append(tensor.data_ptr() % 16 == 0)
    for i, specialize in int_at:
        value = args[i]
        if specialize:
            key.append(value % 16 if -(2**31) <= value < 2**31 and value != 1 else _int_class(value, True) + 16)
        else:
            key.append(-(2**31) <= value < 2**31 or _int_class(value, False))
    return tuple(key)


class TunedKernel:
    """One persistent ``@triton.jit`` kernel: a config per tuning key, chosen once by timing every
    candidate on the call's own inputs, then launches that skip Triton's autotuner and JIT dispatch.

    The first launch of a (variant, config, argument specialisation, device) goes through
    ``kernel[grid](...)``, which compiles and returns the compiled kernel; later launches call that
    compiled kernel's launcher directly with the same arguments (``bound_args.values()`` of the JIT
    path: runtime arguments, then the constexprs in signature order). The specialisation key mirrors
    what ``triton.jit`` specialises on (pointer dtypes and alignment to 16 bytes; ints equal to 1,
    multiples of 16, their width; float arguments must be Python floats), so a launch never reuses a
    kernel compiled for other assumptions.
    """

    def __init__(self, name: str, fn: Any, *, pointers: Sequence[str], floats: Sequence[str],
                 key_names: Sequence[str]) -> None:
        self.name = name
        self.fn = fn
        self.key_names = tuple(key_names)
        names = list(inspect.signature(fn.fn).parameters)
        constexpr = ["constexpr" in str(p.annotation) for p in inspect.signature(fn.fn).parameters.values()]
        self.num_runtime = constexpr.index(True)
        if not all(constexpr[self.num_runtime:]):
            raise TypeError(f"{name}: constexpr parameters must come after all runtime ones")
        params = getattr(fn, "params", None)  # JITFunction; the interpreter's function has none
        unspecialized = {p.name for p in params if p.do_not_specialize} if params is not None else set()
        runtime = names[: self.num_runtime]
        self._pointer_at = tuple(i for i, n in enumerate(runtime) if n in pointers)
        self._int_at = tuple(
            (i, n not in unspecialized) for i, n in enumerate(runtime) if n not in pointers and n not in floats
        )
        self.constexpr_names = tuple(names[self.num_runtime:])
        self.chosen: dict[tuple, Config] = {}
        self.trials: dict[tuple, dict[Config, float | str]] = {}
        self.last: tuple[tuple, Config] | None = None
        self._compiled: dict[tuple, tuple[Any, tuple]] = {}

    def launch(
        self,
        args: tuple,
        constexprs: Callable[[], dict[str, Any]],
        *,
        variant: tuple,
        buckets: tuple,
        configs: Sequence[Config],
        device: torch.device,
        tile_bound: Callable[[Config], int],
        after_tuning: Callable[[], None] | None = None,
    ) -> None:
        """Launch on ``args`` (the runtime arguments, in order). ``variant`` must determine
        ``constexprs()`` (the constexpr arguments other than the config's); ``buckets`` joins it in
        the tuning key. ``after_tuning`` restores outputs that tuning runs accumulated into."""
        key = variant + buckets
        config = self.chosen.get(key)
        if config is None:
            config = self._tune(key, args, constexprs, variant, configs, device, tile_bound)
            if after_tuning is not None:
                after_tuning()
        self.last = (key, config)
        self._run(config, args, constexprs, variant, device, tile_bound)

    def _tune(self, key: tuple, args: tuple, constexprs: Callable[[], dict[str, Any]], variant: tuple,
              configs: Sequence[Config], device: torch.device, tile_bound: Callable[[Config], int]) -> Config:
        if len(configs) == 1:
            self.chosen[key] = configs[0]
            return configs[0]
        from triton.testing import do_bench

        self._precompile(configs, args, constexprs())
        trials: dict[Config, float | str] = {}
        for config in configs:

            def run(config: Config = config) -> None:
                self._run(config, args, constexprs, variant, device, tile_bound)

            try:
                run()  # compiles
                trials[config] = float(do_bench(run, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, return_mode="median"))
            except Exception as exc:  # a config that cannot compile or launch here drops out
                trials[config] = f"{type(exc).__name__}: {exc}"[:300]
        timed = {c: t for c, t in trials.items() if isinstance(t, float)}
        self.trials[key] = trials
        if not timed:
            raise RuntimeError(f"{self.name}: no config could run: {trials}")
        self.chosen[key] = min(timed, key=timed.__getitem__)
        return self.chosen[key]

    def _precompile(self, configs: Sequence[Config], args: tuple, constexprs: dict[str, Any]) -> None:
        """Compile the candidates side by side (Triton's ``AsyncCompileMode``: compiles run in a
        thread pool) before they are timed one by one; a candidate that fails here fails again, and
        is reported, when its timing run compiles it."""
        workers = min(len(configs), os.cpu_count() or 1)
        if INTERPRET or workers < 2:
            return
        try:
            from concurrent.futures import ThreadPoolExecutor

            from triton.runtime._async_compile import AsyncCompileMode

            with ThreadPoolExecutor(workers) as pool, AsyncCompileMode(pool, ignore_errors=True):
                for block_m, block_n, warps, stages, per_sm in configs:
                    self.fn.warmup(
                        *args, grid=(1,), **constexprs, BLOCK_M=block_m, BLOCK_N=block_n, PROGRAMS_PER_SM=per_sm,
                        num_warps=warps, num_stages=stages,
                    )
        except Exception:  # an optimisation only: the timing runs compile what is missing
            pass

    def _run(self, config: Config, args: tuple, constexprs: Callable[[], dict[str, Any]], variant: tuple,
             device: torch.device, tile_bound: Callable[[Config], int]) -> None:
        programs = num_programs(device, config[4], tile_bound(config))
        if INTERPRET or not DIRECT_LAUNCH:
            self._jit_launch(config, args, constexprs(), programs)
            return
        entry_key = (variant, config, device.index, _spec(args, self._pointer_at, self._int_at))
        entry = self._compiled.get(entry_key)
        if entry is None:
            values = constexprs()
            compiled = self._jit_launch(config, args, values, programs)
            if compiled is not None and getattr(compiled, "function", None) is not None:
                values = {**values, "BLOCK_M": config[0], "BLOCK_N": config[1], "PROGRAMS_PER_SM": config[4]}
                tail = tuple(values[name] for name in self.constexpr_names)
                self._compiled[entry_key] = (compiled, tail)
            return
        compiled, tail = entry
        stream = current_stream(device.index)
        enter_hook = knobs.runtime.launch_enter_hook
        if enter_hook is None or getattr(enter_hook, "calls", None) == []:
            metadata = None  # nobody to read it (an empty hook chain): skip building it
        else:
            metadata = compiled.launch_metadata((programs, 1, 1), stream, *args, *tail)  # as the JIT path does
        compiled.run(programs, 1, 1, stream, compiled.function, compiled.packed_metadata, metadata, enter_hook,
                     knobs.runtime.launch_exit_hook, *args, *tail)

    def _jit_launch(self, config: Config, args: tuple, constexprs: dict[str, Any], programs: int) -> Any:
        block_m, block_n, warps, stages, per_sm = config
        return self.fn[(programs,)](
            *args, **constexprs, BLOCK_M=block_m, BLOCK_N=block_n, PROGRAMS_PER_SM=per_sm, num_warps=warps,
            num_stages=stages,
        )

    def records(self) -> dict[str, dict[str, Any]]:
        """Per tuning key: the chosen config and every candidate's median ms (or why it could not run)."""
        return {
            f"{self.name}({key_label(self.key_names, key)})": {
                "chosen": config_str(config),
                "trials_ms": {config_str(c): t for c, t in self.trials.get(key, {}).items()},
            }
            for key, config in self.chosen.items()
        }


def key_label(names: Sequence[str], key: tuple) -> str:
    return ", ".join(f"{n}={str(v).removeprefix('torch.')}" for n, v in zip(names, key, strict=True))


def config_str(config: Config) -> str:
    block_m, block_n, warps, stages, per_sm = config
    return f"BLOCK_M={block_m} BLOCK_N={block_n} warps={warps} stages={stages} programs/SM={per_sm}"


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
