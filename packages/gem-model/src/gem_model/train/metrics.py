"""Throughput and MFU accounting, and the per-run JSONL metrics file."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gem_model.train.tensorboard import TensorBoardWriter

# Dense peak FLOP/s of one GPU (tensor cores, without 2:4 sparsity), by the dtype its GEMMs run in.
# Sources, NVIDIA datasheets: "H100 Tensor Core GPU" (SXM: BF16 1,979 and FP8 3,958 TFLOPS *with
# sparsity*, so 989 and 1,979 dense; FP32 67), "H200 Tensor Core GPU" (SXM: the same tensor-core
# figures as H100 SXM), "HGX B200" / "DGX B200" (per GPU: FP8 9 and BF16 4.5 PFLOPS with sparsity,
# so 4.5 and 2.25 dense; FP32 80 TFLOPS), "A100 Tensor Core GPU" (BF16 312 dense, FP32 19.5, no
# FP8: an fp8 scheme there runs at the BF16 rate at best).
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H100": {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12},
    "B200": {"bf16": 2250e12, "fp8": 4500e12, "fp32": 80e12},
    "A100": {"bf16": 312e12, "fp8": 312e12, "fp32": 19.5e12},
}
# PrecisionScheme.gemm_dtype -> the column of PEAK_FLOPS (fp16 runs at the bf16 rate)
PEAK_COLUMN = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16", "float8": "fp8"}


@functools.cache
def measure_cpu_peak(seconds: float = 0.3) -> float:
    """FLOP/s of a square fp32 matmul on this CPU: the MFU denominator where no table entry applies.
    Measured once per process: the CPU does not change between the runs one process builds (tune's
    candidates, a test session), and each measurement spends ``seconds`` of it."""
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    return 2.0 * n**3 * count / (time.perf_counter() - start)


def datasheet_peak(device: torch.device, gemm_dtype: str) -> tuple[float, str] | None:
    """(dense peak FLOP/s of ``device`` for GEMMs in ``gemm_dtype``, its source), None off the table."""
    if gemm_dtype not in PEAK_COLUMN:
        raise ValueError(f"gemm_dtype {gemm_dtype!r} is not one of {sorted(PEAK_COLUMN)}")
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    column = PEAK_COLUMN[gemm_dtype]
    for key, table in PEAK_FLOPS.items():
        if key in name:
            return table[column], f"{key} {column} datasheet"
    return None


def peak_flops(device: torch.device, gemm_dtype: str, override: float | None = None) -> tuple[float, str]:
    """(peak FLOP/s of one device for GEMMs in ``gemm_dtype``, where the figure came from).

    ``gemm_dtype`` is what the run's precision scheme declares (:attr:`PrecisionScheme.gemm_dtype
    <gem_model.components.PrecisionScheme.gemm_dtype>`)."""
    if override is not None:
        return override, "trainer.peak_flops"
    sheet = datasheet_peak(device, gemm_dtype)
    if sheet is not None:
        return sheet
    if device.type == "cuda":
        raise ValueError(f"no peak FLOP/s known for {torch.cuda.get_device_name(device)!r}: set trainer.peak_flops")
    return measure_cpu_peak(), "measured fp32 matmul on this CPU"


class MetricsFile:
    """Appends one JSON object per line; only rank 0 writes. With ``tensorboard``, every record also
    goes to TensorBoard scalars in the folder ``tensorboard/`` beside the file (``trainer.tensorboard``)."""

    def __init__(self, path: Path | None, *, tensorboard: bool = False):
        self.path = path
        self._fh: IO[str] | None = None
        self._tensorboard: TensorBoardWriter | None = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if tensorboard:
                from gem_model.train.tensorboard import SUBDIR, TensorBoardWriter

                self._tensorboard = TensorBoardWriter(path.parent / SUBDIR)
            self._fh = path.open("a")

    def write(self, record: dict[str, Any]) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps(record) + "\n")
            self._fh.flush()
        if self._tensorboard is not None:
            self._tensorboard.write(record)

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


class Throughput:
    """Running totals for the summary; the first ``warmup`` steps are left out of the rates."""

    def __init__(self, warmup: int = 2):
        self.warmup = warmup
        self.steps = 0
        self.seconds = 0.0
        self.samples = 0.0
        self.tokens = 0.0
        self.flops = 0.0

    def add(self, seconds: float, samples: float, tokens: float, flops: float) -> None:
        self.steps += 1
        if self.steps <= self.warmup:
            return
        self.seconds += seconds
        self.samples += samples
        self.tokens += tokens
        self.flops += flops

    def rates(self) -> dict[str, float]:
        s = max(self.seconds, 1e-12)
        return {
            "samples_per_s": self.samples / s,
            "tokens_per_s": self.tokens / s,
            "flops_per_s": self.flops / s,
        }


class StepClock:
    """Seconds per step without a device sync per step: the wall time between consecutive step ends.

    A step returns once its work is queued, not done. The next step's one host sync (the loss check)
    waits for the device, so the host never runs more than about a step ahead, and in steady state
    the time between two step ends is the time a step takes on the device. ``restart()`` after work
    between steps that is not a step (checkpoints, evaluation): the next step is then timed from its
    own start.
    """

    def __init__(self) -> None:
        self._mark: float | None = None

    def begin(self) -> None:
        """A step starts: measure from here unless the previous step's end is the mark."""
        if self._mark is None:
            self._mark = time.perf_counter()

    def lap(self) -> float:
        """A step ends: seconds since the mark, which moves here."""
        now = time.perf_counter()
        seconds = now - (self._mark if self._mark is not None else now)
        self._mark = now
        return seconds

    def restart(self) -> None:
        self._mark = None
