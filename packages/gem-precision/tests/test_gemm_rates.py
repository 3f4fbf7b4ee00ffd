"""The measured rates of the device at hand: what each scheme's linears cost, timed once per process
(on this CPU, with the same code that times a GPU), and the arithmetic of the rate table."""

from __future__ import annotations

import pytest
import torch

from gem_precision.gemm_rates import AS_IS, MAX_ROWS, Backend, LinearShape, RateTable, Timing, measure_rates
from gem_precision.schemes import Bf16Scheme, Fp8RowwiseScheme, MXFP8Scheme

CPU = torch.device("cpu")


def test_every_scheme_is_timed_on_every_shape_once_per_process():
    schemes = {"bf16": Bf16Scheme(), "fp8_rowwise": Fp8RowwiseScheme(Fp8RowwiseScheme.Config()),
               "mxfp8": MXFP8Scheme(MXFP8Scheme.Config())}  # fmt: skip
    shapes = [LinearShape(32, 64, 48), LinearShape(64, 32, 16)]
    table = measure_rates(schemes, shapes, CPU, torch.bfloat16)
    assert list(table.backends) == [AS_IS, "bf16", "fp8_rowwise", "mxfp8"]
    assert [table.backends[n].emulated for n in table.backends] == [False, False, True, True]  # no fp8 on a CPU
    for name in table.backends:
        for shape in shapes:
            t = table.timings[name][shape.key]
            assert t.error is None and t.rows == shape.rows and t.linear_s > 0 and t.gemm_s > 0, (name, shape)
        assert table.tflops(name) > 0 and table.tflops(name, gemm_only=True) > 0
    again = measure_rates(schemes, shapes, CPU, torch.bfloat16)
    assert all(again.timings[n][k] is table.timings[n][k] for n in table.timings for k in table.timings[n])
    data = table.to_json()
    assert data["schemes"]["mxfp8"]["emulated"] and set(data["schemes"]["bf16"]["shapes"]) == {s.key for s in shapes}


def test_a_backend_the_device_lacks_is_reported_not_timed():
    native = Fp8RowwiseScheme(Fp8RowwiseScheme.Config(backend="native"))
    table = measure_rates({"fp8_rowwise": native}, [LinearShape(16, 16, 8)], CPU, torch.bfloat16)
    assert "needs a CUDA device with compute capability >= 8.9" in (table.backends["fp8_rowwise"].error or "")
    assert "fp8_rowwise" not in table.timings and table.seconds("fp8_rowwise", LinearShape(16, 16, 8)) is None


def test_rates_and_times_by_hand():
    big, small = LinearShape(100, 200, 4 * MAX_ROWS), LinearShape(10, 20, 50)
    assert (big.timed_rows, small.timed_rows) == (MAX_ROWS, 50)
    table = RateTable("test", {"s": Backend("native", False, "-")}, shapes={big.key: big, small.key: small})
    table.timings["s"] = {big.key: Timing(2.0, 1.0, MAX_ROWS), small.key: Timing(0.5, None, 50)}
    assert table.seconds("s", big) == 8.0  # timed at a quarter of its rows: a GEMM's time grows linearly
    assert table.seconds("s", small) == 0.5
    flops = 6 * MAX_ROWS * 100 * 200 + 6 * 50 * 10 * 20  # three GEMMs of 2 x rows x in x out
    assert table.tflops("s") == pytest.approx(flops / 2.5 / 1e12)
    assert table.tflops("s", gemm_only=True) == pytest.approx(6 * MAX_ROWS * 100 * 200 / 1.0 / 1e12)
    assert table.quantization_share("s") == pytest.approx(0.5)  # only where both were timed
