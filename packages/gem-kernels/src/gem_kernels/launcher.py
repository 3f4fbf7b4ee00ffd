"""The launcher of the persistent Triton kernels: a tile config per tuning key, chosen once by timing
the candidates on the call's own inputs, then direct launches of the compiled kernel that skip
Triton's autotuner and JIT dispatch.

Imported only when a Triton kernel is used (it imports triton at module level).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from triton import knobs

from gem_kernels.attention_triton_common import INTERPRET, current_stream, num_programs

DIRECT_LAUNCH = os.environ.get("GEM_KERNELS_DIRECT_LAUNCH", "1").strip().lower() not in ("0", "false", "no", "off")
"""Launch cached compiled kernels without Triton's JIT dispatch (set ``GEM_KERNELS_DIRECT_LAUNCH=0`` to
always go through ``kernel[grid](...)``)."""

TUNE_WARMUP_MS, TUNE_REP_MS = 10, 50
"""``do_bench`` budgets per config when tuning (Triton's autotuner takes 25 and 100: a benchmark run
tunes some fifteen keys of up to seven configs each)."""

Config = tuple[int, int, int, int, int]
"""(BLOCK_M, BLOCK_N, num_warps, num_stages, programs per SM)."""


def fixed_config(block_m: int, block_n: int) -> Config:
    """Tile sizes set by hand: two warpgroups once a tile's fp32 scores would crowd one."""
    warps = 1 if INTERPRET else (8 if block_m * block_n >= 128 * 64 else 4)
    return (block_m, block_n, warps, 1 if INTERPRET else 2, 1)


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
