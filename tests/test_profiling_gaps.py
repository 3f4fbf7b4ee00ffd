"""benchmarks/profiling.py: what the host did while the device waited, read from a chrome trace."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _profiling():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("profiling", ROOT / "benchmarks" / "profiling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _ev(cat: str, name: str, ts: float, dur: float) -> dict:
    return {"cat": cat, "name": name, "ts": ts, "dur": dur}


def test_each_long_gap_names_the_host_events_that_cover_it_innermost_first():
    p = _profiling()
    trace = [
        _ev("kernel", "gemm", 0, 100),
        _ev("kernel", "silu", 150, 10),  # a 50 us gap after gemm, no host event covers it
        _ev("kernel", "fill", 1160, 5),  # a 1 ms gap after silu: the host waited in a sync
        _ev("cpu_op", "Step", 0, 2000),  # the step's annotation covers everything: listed last
        _ev("cpu_op", "aten::item", 200, 900),
        _ev("cuda_runtime", "cudaStreamSynchronize", 210, 880),
        _ev("cpu_op", "aten::add", 120, 20),  # ended inside the first gap
        _ev("cpu_op", "aten::zeros", 2500, 1),  # outside every gap
    ]
    gaps = p.host_during_gaps(trace, limit=5)
    assert [round(g["ms"], 3) for g in gaps] == [1.0, 0.05]
    sync, short = gaps
    assert (sync["device_before"], sync["device_after"]) == ("silu", "fill")
    assert [h.split(" (")[0] for h in sync["host_covering"]] == ["cudaStreamSynchronize", "aten::item", "Step"]
    assert sync["host_covering"][0].endswith("(0.880 ms)")
    assert [h.split(" (")[0] for h in short["host_covering"]] == ["Step"]
    assert [h.split(" (")[0] for h in short["host_ended_inside"]] == ["aten::add"]
    assert p.device_events(trace) == trace[:3]  # only the device's work counts as busy


def _launched(name: str, ts: float, dur: float, corr: int) -> dict:
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def _launch(ts: float, corr: int, tid: int = 1) -> dict:
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5, "tid": tid, "args": {"correlation": corr}}


def _op(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_idle_is_summed_by_the_operator_that_launched_the_work_after_each_gap():
    p = _profiling()
    trace = [
        # forward: two short gaps before kernels launched by aten::index_select under the model's forward
        _op("Model.forward", 0, 400), _op("aten::index_select", 100, 30), _op("aten::index_select", 200, 30),
        _launch(110, 2), _launch(210, 3), _launch(5, 1),
        _launched("gemm", 10, 100, 1), _launched("gather", 130, 10, 2), _launched("gather", 250, 10, 3),
        # backward, on the autograd thread: a gap before the kernel of a mul inside MulBackward0
        _op("autograd::engine::evaluate_function: MulBackward0", 500, 300, tid=2), _op("MulBackward0", 505, 290, tid=2),
        _op("aten::mul", 510, 280, tid=2), _launch(780, 4, tid=2), _launched("mul", 800, 5, 4),
    ]
    rows = p.idle_by_launcher(trace, steps=2)
    by = {(r["launcher"], r["scope"]): r for r in rows}
    assert set(by) == {("aten::mul", "MulBackward0"), ("aten::index_select", "Model.forward")}
    mul = by[("aten::mul", "MulBackward0")]
    assert mul["gaps_per_step"] == 0.5 and abs(mul["idle_ms_per_step"] - (800 - 260) / 1e3 / 2) < 1e-9
    gather = by[("aten::index_select", "Model.forward")]
    assert gather["gaps_per_step"] == 1.0 and abs(gather["idle_ms_per_step"] - (20 + 110) / 1e3 / 2) < 1e-9
    assert rows[0]["launcher"] == "aten::mul"  # the most idle first


def test_torch_kernels_are_summed_by_the_operator_and_scope_that_launched_them():
    p = _profiling()
    add = "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>>"
    trace = [
        # forward: a cat inside an autograd Function's forward (its name is the scope), a GEMM beside it
        _op("DistributedDataParallel.forward", 0, 400), _op("_SharedScores", 10, 300), _op("aten::cat", 20, 30),
        _op("aten::mm", 60, 30), _launch(25, 1), _launch(65, 2),
        _launched("void at::native::CatArrayBatchedCopy<float>", 100, 40, 1), _launched("nvjet_sm90_tst_256x160", 140, 90, 2),
        # backward: two adds of the same node, and one of our Triton kernels that is not counted
        _op("autograd::engine::evaluate_function: AddBackward0", 500, 300, tid=2), _op("aten::add", 510, 100, tid=2),
        _launch(520, 3, tid=2), _launch(560, 4, tid=2), _op("_norm_bwd_launch", 700, 50, tid=2), _launch(710, 5, tid=2),
        _launched(add, 600, 20, 3), _launched(add, 630, 30, 4), _launched("_norm_bwd", 700, 60, 5),
    ]
    rows = p.work_by_launcher(trace, steps=2, keep=p.torch_kernel)
    assert [(r["launcher"], r["scope"]) for r in rows] == [("aten::add", "AddBackward0"), ("aten::cat", "_SharedScores")]
    assert abs(rows[0]["ms_per_step"] - 50 / 1e3 / 2) < 1e-12 and rows[0]["kernels"] == [add[:60]]
    assert abs(rows[1]["ms_per_step"] - 40 / 1e3 / 2) < 1e-12
    every = p.work_by_launcher(trace, steps=1)  # without a filter the GEMM and the Triton kernel count too
    assert abs(sum(r["ms_per_step"] for r in every) - (40 + 90 + 20 + 30 + 60) / 1e3) < 1e-12


def test_torch_kernel_tells_torch_kernels_from_ours_and_gemms():
    p = _profiling()
    ours = ["query_major_kernel", "_silu_grad_rows", "_norm_gate_bwd", "nvjet_sm90_tst_128x256_64x4", "cutlass_80_tensorop"]
    torch_own = ["void at::native::reduce_kernel<128, 4>", "Memcpy DtoD (Device -> Device)", "void gemv2T_kernel_val<int>"]
    assert not any(p.torch_kernel(n) for n in ours)
    assert all(p.torch_kernel(n) for n in torch_own)
