"""The direct launch path against Triton's own: with a stand-in CUDA driver (kernels compiled for sm_90
on the CPU, launches recorded instead of run), a launch through the cached compiled kernel must hand
Triton's launcher exactly what ``kernel[grid](...)`` hands it, and a change of argument
specialisation (strides, alignment, dtypes) must go back through the JIT path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os
os.environ["TRITON_INTERPRET"] = "0"
import torch
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase
from triton.runtime.driver import driver

LAUNCHES = []

class Utils:
    def load_binary(self, name, kernel, shared, device):
        return (1, 1, 128, 0, 1024)
    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

class Launcher:
    def __init__(self, src, metadata):
        pass
    def __call__(self, *args):
        LAUNCHES.append(args)

class StandIn(DriverBase):
    def __init__(self):
        self.utils = Utils()
        self.launcher_cls = Launcher
        self.get_current_device = lambda: 0
        self.get_current_stream = lambda index=None: 7
        self.get_device_capability = lambda index=None: (9, 0)
        self.set_current_device = lambda index: None
    @classmethod
    def is_active(cls):
        return True
    def map_python_to_cpp_type(self, ty):
        return ty
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)
    def get_active_torch_device(self):
        return torch.device("cpu")
    def get_benchmarker(self):
        raise NotImplementedError
    def get_device_interface(self):
        return torch.cuda

driver.set_active(StandIn())

from gem_kernels import attention_triton_common as common
from gem_kernels import launcher
common.num_sms = lambda index: 132
from gem_kernels.attention_triton import DQ, FORWARD, query_major
from gem_kernels.attention_triton_bwd import DKDV, DKDV_ATOMIC, key_major
from gem_kernels.attention_triton_bias import BiasGrads, prepare_bias

assert not common.INTERPRET and launcher.DIRECT_LAUNCH
recorded = []
original_run = launcher.TunedKernel._run

def recording_run(self, *args, **kwargs):
    recorded.append((self, args, kwargs))
    return original_run(self, *args, **kwargs)

launcher.TunedKernel._run = recording_run

def same(a, b):
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return type(a) is type(b) and a == b

gen = torch.Generator().manual_seed(0)
offsets = torch.tensor([0, 5, 5, 21, 40])
targets = torch.tensor([1, 0, 3, 2])
report = {}
# Same shapes and dtypes each time: only the specialisation changes (strides not multiples of 16,
# then pointers off 16-byte alignment), which must give a new compiled entry, not reuse the last.
for layout in ("contiguous", "fused", "misaligned"):
    if layout == "contiguous":
        q, k, v = (torch.randn(40, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    elif layout == "fused":
        q, k, v, _ = torch.randn(40, 2, 49, generator=gen).to(torch.bfloat16).split([16, 16, 16, 1], dim=-1)
    else:
        _, q, k, v, _ = torch.randn(40, 2, 64, generator=gen).to(torch.bfloat16).split([1, 16, 16, 16, 15], dim=-1)
    grad_out = torch.randn(40, 2, 16, generator=gen).to(torch.bfloat16)
    common_args = dict(max_seq_len=21, alpha=0.25, blocks=(16, 16))
    accum = torch.zeros(40, 2, 16)
    calls = {
        "forward": lambda: query_major(q, k, v, None, offsets, targets, max_attn_len=0, **common_args),
        "dq": lambda: query_major(q, k, v, grad_out, offsets, targets, max_attn_len=3, **common_args),
        "dkdv": lambda: key_major(q, k, v, grad_out, offsets, None, None, max_attn_len=0, **common_args),
        "dkdv_atomic": lambda: key_major(q, k, v, grad_out, offsets, targets, accum, max_attn_len=0, **common_args),
    }
    if layout == "contiguous":  # the relative biases add pointer and int arguments: the same must hold
        bias = prepare_bias(torch.randn(41), torch.randn(16), torch.arange(40) * 1000, torch.arange(40) * 1000 + 7, 21)
        grads = BiasGrads.zeros(bias, True, True, 21, torch.device("cpu"))
        calls["forward+bias"] = lambda: query_major(q, k, v, None, offsets, targets, max_attn_len=2, bias=bias,
                                                    **common_args)
        calls["dkdv_atomic+bias"] = lambda: key_major(q, k, v, grad_out, offsets, targets, accum, max_attn_len=0,
                                                      bias=bias, bias_grads=grads, **common_args)
    for name, call in calls.items():
        kernel = {"forward": FORWARD, "dq": DQ, "dkdv": DKDV, "dkdv_atomic": DKDV_ATOMIC}[name.split("+")[0]]
        entries = len(kernel._compiled)
        recorded.clear(); LAUNCHES.clear()
        call()  # a new specialisation: through kernel[grid](...), which compiles
        assert len(kernel._compiled) == entries + 1, (name, layout, "no new compiled entry")
        self_, run_args, run_kwargs = recorded[-1]
        original_run(self_, *run_args, **run_kwargs)  # the same arguments again: the direct path
        assert len(kernel._compiled) == entries + 1, (name, layout, "the repeat added an entry")
        via_jit, direct = LAUNCHES
        assert len(via_jit) == len(direct), (name, layout, len(via_jit), len(direct))
        assert len(via_jit) == 9 + len(kernel.fn.arg_names), (name, layout)
        # grid, stream, function and packed metadata; launch metadata (skipped when no hook reads it); hooks
        for i in (0, 1, 2, 3, 4, 5, 7, 8):
            assert same(via_jit[i], direct[i]), (name, layout, i, via_jit[i], direct[i])
        assert direct[6] is None or type(direct[6]) is type(via_jit[6]), (name, layout)
        for i, (a, b) in enumerate(zip(via_jit[9:], direct[9:])):
            assert same(a, b), (name, layout, kernel.fn.arg_names[i], a, b)
        report[f"{name}/{layout}"] = len(via_jit)
        if name == "forward" and layout == "contiguous":
            forward_call = (run_args, run_kwargs)

# Tuning compiles its candidates side by side first (AsyncCompileMode): afterwards the JIT cache holds
# them, and their first launches compile nothing more.
config, args, constexprs, variant, device, tile_bound = forward_call[0]
jit_cache = FORWARD.fn.device_caches[0][0]
before = len(jit_cache)
candidates = [config, (32, 16, 4, 2, 1), (16, 32, 4, 3, 1)]
FORWARD._precompile(candidates, args, constexprs())
assert len(jit_cache) == before + 2, (before, len(jit_cache))
LAUNCHES.clear()
for candidate in candidates:
    original_run(FORWARD, candidate, args, constexprs, variant, device, tile_bound)
assert len(jit_cache) == before + 2 and len(LAUNCHES) == 3
report["precompiled"] = len(jit_cache) - before
print(json.dumps(report))
"""


def test_direct_launch_passes_what_the_jit_passes() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(report) == 15 and report["precompiled"] == 2, report


def test_specialisation_key_refines_tritons() -> None:
    """Two int arguments that get one key from us get one specialisation from Triton (the key may be
    finer, never coarser), with and without ``do_not_specialize``."""
    pytest.importorskip("triton.backends.nvidia")
    import torch
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend

    from gem_kernels.launcher import _spec

    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    values = [0, 1, 2, 15, 16, 17, 31, 32, 33, 48, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 1, 2**32, 2**32 + 1,
              2**63 - 16, 2**63, 2**63 + 16, -1, -16, -17, -(2**31), -(2**31) - 1, -(2**31) - 16]
    for specialize in (True, False):
        seen: dict[object, object] = {}
        for value in values:
            ours = _spec((value,), (), ((0, specialize),))
            theirs = native_specialize_impl(backend, value, False, specialize, True)
            assert seen.setdefault(ours, theirs) == theirs, (value, specialize, ours, theirs, seen[ours])
    tensor = torch.zeros(8, dtype=torch.bfloat16)
    for view in (tensor, tensor[1:], tensor[8:]):
        ours = _spec((view,), (0,), ())
        theirs = native_specialize_impl(backend, view, False, True, True)
        assert ours == (view.dtype, theirs[1] == "D"), (ours, theirs)
