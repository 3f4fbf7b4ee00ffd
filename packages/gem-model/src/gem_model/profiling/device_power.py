"""The GPU's power draw and SM clock while training steps run, sampled by ``nvidia-smi``.

A Hopper card training the big config draws its whole power limit: on one H100 (2026-12-06) the
samples above 300 W during an ``e2e_ab.py`` call had a median of 692 W against the 700 W limit, the SM
clock a median of 1,695 MHz against its 1,980 MHz maximum, and the driver named the power cap as the
reason for the lower clock in 97 % of them. At that cap, a change that saves a kernel's time alone may save nothing in the
step (the clock takes the saved energy back). So the profile's MFU section reports the clock and power
of its unprofiled steps (:class:`gem_model.profiling.step_probe.StepProbe`), and ``benchmarks/e2e_ab.py``
reports them beside each variant for its own steps.

``nvidia-smi --query-gpu=... --loop-ms=N`` runs beside the steps and prints one line a sample, with the
time it was taken (its output to a pipe comes in blocks, so the time a line arrives says little); a thread
reads them. A variant's figures are the samples taken inside its steps' wall-time windows. Where
``nvidia-smi`` is missing or fails, nothing is sampled and the reason is kept.
"""

from __future__ import annotations

import atexit
import datetime
import statistics
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SAMPLE_MS = 100
"""How often the profile samples (``e2e_ab.py --power-ms`` sets its own)."""
FIELDS = ("timestamp", "power.draw", "clocks.sm", "clocks_event_reasons.sw_power_cap", "power.limit")
"""What each sample asks ``nvidia-smi`` for, in this order (``--format=csv,noheader,nounits``)."""


@dataclass(frozen=True)
class Sample:
    at: float
    """When it was taken, on ``time.perf_counter()``'s clock (the one the steps are timed by)."""
    watts: float
    sm_mhz: float
    power_capped: bool
    limit_watts: float


TIMESTAMP = "%Y/%m/%d %H:%M:%S.%f"
"""How ``nvidia-smi`` writes ``timestamp``: the machine's local time."""


def parse_line(line: str, offset: float) -> Sample | None:
    """One ``nvidia-smi`` line (``FIELDS``, no units) as a :class:`Sample`, its time moved onto
    ``time.perf_counter()``'s clock by ``offset`` (``time.time() - time.perf_counter()``); None for a line
    that is not one (a header, an error, ``[N/A]``)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    try:
        taken = datetime.datetime.strptime(parts[0], TIMESTAMP).timestamp()
        watts, mhz, limit = float(parts[1]), float(parts[2]), float(parts[4])
    except ValueError:
        return None
    if parts[3] not in ("Active", "Not Active"):
        return None
    return Sample(taken - offset, watts, mhz, parts[3] == "Active", limit)


POWER_FIELDS = ("power.draw", "power.draw.instant")
"""What a sample's power can be: ``power.draw`` (on recent drivers averaged over the last second, which
steps of a few seconds a variant can take) or ``power.draw.instant`` (for windows of a few seconds, as
``benchmarks/kernel_energy.py`` times one kernel in)."""


def nvidia_smi_command(device_uuid: str | None, interval_ms: int, power_field: str = "power.draw") -> list[str]:
    """The sampling command for the GPU with this UUID (all GPUs' lines if None), its power read from
    ``power_field`` (one of :data:`POWER_FIELDS`)."""
    if power_field not in POWER_FIELDS:
        raise ValueError(f"power_field must be one of {POWER_FIELDS}, got {power_field!r}")
    fields = [power_field if f == "power.draw" else f for f in FIELDS]
    command = ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", f"--loop-ms={interval_ms}"]
    if device_uuid:
        command.append(f"--id={device_uuid if device_uuid.startswith('GPU-') else 'GPU-' + device_uuid}")
    return command


class PowerSampler:
    """Runs ``command`` (:func:`nvidia_smi_command`) from :meth:`start` to :meth:`stop`, keeping every line
    that parses as a :class:`Sample`; ``failure`` says why there are none when it could not run."""

    def __init__(self, command: Sequence[str]) -> None:
        self.command = list(command)
        self.samples: list[Sample] = []
        self.failure: str | None = None
        self._process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None
        self._offset = 0.0

    def start(self) -> None:
        self._offset = time.time() - time.perf_counter()
        try:
            self._process = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        except OSError as e:
            self.failure = f"{self.command[0]} did not start: {e}"
            return
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def running(self) -> bool:
        """Whether the sampling process is still running."""
        return self._process is not None and self._process.poll() is None

    def _read(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            sample = parse_line(line, self._offset)
            if sample is not None:
                self.samples.append(sample)

    def stop(self) -> None:
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
        try:
            _, err = self._process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            _, err = self._process.communicate()
        if self._reader is not None:
            self._reader.join(timeout=10)
        if not self.samples and self.failure is None:
            self.failure = f"{self.command[0]} gave no sample (exit {self._process.returncode}): {(err or '').strip()[:200]}"
        self._process = None

    def within(self, windows: Sequence[tuple[float, float]]) -> list[Sample]:
        """The samples taken inside any of these ``(start, end)`` ``time.perf_counter()`` windows."""
        return [s for s in self.samples if any(a <= s.at <= b for a, b in windows)]


def sampler_for(device: torch.device, interval_ms: int = SAMPLE_MS, power_field: str = "power.draw") -> PowerSampler | None:
    """A sampler of this CUDA device (by its UUID), stopped at exit if it is still running then (so none is
    left behind by steps that fail); None for another device or ``interval_ms`` 0 or less."""
    if device.type != "cuda" or interval_ms <= 0:
        return None
    import torch

    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", "") or "") or None
    sampler = PowerSampler(nvidia_smi_command(uuid, interval_ms, power_field))
    atexit.register(sampler.stop)
    return sampler


def summarize(samples: Sequence[Sample]) -> dict | None:
    """Median and mean power, median SM clock, the power limit, and the share of samples the power cap held
    in; None without samples. The mean power times the steps' mean wall time is their energy a step
    (:func:`joules_per_step`)."""
    if not samples:
        return None
    return {"samples": len(samples), "watts_median": statistics.median(s.watts for s in samples),
            "watts_mean": statistics.fmean(s.watts for s in samples),
            "limit_watts": max(s.limit_watts for s in samples),
            "sm_mhz_median": statistics.median(s.sm_mhz for s in samples),
            "sm_mhz_min": min(s.sm_mhz for s in samples), "sm_mhz_max": max(s.sm_mhz for s in samples),
            "power_capped_share": sum(s.power_capped for s in samples) / len(samples)}  # fmt: skip


def joules_per_step(summary: dict | None, step_ms: float) -> float | None:
    """The energy of a step that took ``step_ms`` on average while the GPU drew ``summary``'s mean power.
    At the power cap this, not the step's time alone, is what a change must lower (the module's note)."""
    if summary is None or "watts_mean" not in summary:
        return None
    return summary["watts_mean"] * step_ms / 1e3


def describe(summary: dict | None) -> str:
    """One line for a printed table."""
    if summary is None:
        return "not sampled"
    return (f"{summary['watts_median']:.0f} W of {summary['limit_watts']:.0f}, SM clock {summary['sm_mhz_median']:.0f} MHz "
            f"({summary['sm_mhz_min']:.0f}-{summary['sm_mhz_max']:.0f}), power cap in {100 * summary['power_capped_share']:.0f} % "
            f"of {summary['samples']} samples")  # fmt: skip
