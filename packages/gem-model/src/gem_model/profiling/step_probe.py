"""The probe that measures the profile's training steps (:class:`StepProbe`): registered for that run
only, it runs the config's own trainer for ``warmup + steps`` steps, keeps each unprofiled warm-up step's
result and time window (with the GPU's power and clock sampled through them,
:mod:`gem_model.profiling.device_power`), starts ``torch.profiler`` after the warm-up, and records each
measured step's wall time, tokens, FLOPs and the difference of ``CommStrategy.measurements()``, and the
allocator's peak on CUDA. Its :meth:`StepProbe.breakdown` puts the measured steps' time in categories
by :mod:`gem_model.profiling.step_time`'s rules.

The run's attention kernel and embedding collections are wrapped in ``gem::attention`` and
``gem::embeddings`` profiler ranges, which the CPU breakdown reads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.autograd.profiler import record_function

from gem_model.components import JaggedAttentionKernel
from gem_model.config import RunConfig
from gem_model.markers import hookimpl
from gem_model.plugins import GemPluginManager
from gem_model.profiling.context import MeasuredSteps
from gem_model.profiling.device_power import PowerSampler, sampler_for
from gem_model.profiling.device_power import summarize as summarize_power
from gem_model.profiling.step_time import MARKER, ORDER, SCOPES, categorize, device_work, kernel_breakdown
from gem_model.results import StepResult


class _ScopedAttention:
    """The run's attention kernel, called inside a ``gem::attention`` profiler range."""

    def __init__(self, kernel: JaggedAttentionKernel):
        self.kernel = kernel

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with record_function("gem::attention"):
            return self.kernel(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.kernel, name)


def _scope_model(model: torch.nn.Module) -> None:
    for module in model.modules():
        kernel = getattr(module, "attention", None)
        if isinstance(kernel, JaggedAttentionKernel):
            module.attention = _ScopedAttention(kernel)  # type: ignore[assignment]
        elif "EmbeddingCollection" in type(module).__name__ or "EmbeddingBagCollection" in type(module).__name__:
            _scope_module(module, "gem::embeddings")


def _scope_module(module: torch.nn.Module, scope: str) -> None:
    open_ranges: list[record_function] = []

    def enter(*_: Any) -> None:
        open_ranges.append(record_function(scope).__enter__())

    def leave(*_: Any) -> None:
        open_ranges.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


class StepProbe:
    """Registered for the profile's training run only: profiles and measures steps after ``warmup``."""

    def __init__(self, warmup: int, device: torch.device):
        self.warmup, self.device = warmup, device
        self.results: list[StepResult] = []
        self.warmup_results: list[StepResult] = []
        """The unprofiled warm-up steps: the profiler's own host cost is not in their time."""
        self.comm: list[dict[str, float]] = []
        self.comm_name = ""
        self.world_size = 1
        self.profiler: torch.profiler.profile | None = None
        self.peak: int | None = None
        self.kernels: list[tuple[str, float, float]] = []
        """The measured steps' device work on CUDA (:func:`device_work`), after :meth:`breakdown`."""
        self.power: PowerSampler | None = None
        """On CUDA with at least two warm-up steps: ``nvidia-smi`` sampling through the warm-up."""
        self.plain_windows: list[tuple[float, float]] = []
        """``time.perf_counter()`` spans of the unprofiled warm-up steps after the first."""

    @hookimpl
    def gem_run_started(self, run: Any) -> None:
        _scope_model(run.model)
        self.comm_name = run.comm.name
        self.world_size = run.layout.world_size

    @hookimpl(wrapper=True)
    def gem_train_step(self, run: Any, step: int) -> Generator[None, StepResult, StepResult]:
        measured = step - self.warmup
        if step == 0 and self.warmup >= 2:  # unprofiled steps after the first: sample the GPU through them
            self.power = sampler_for(self.device)
            if self.power is not None:
                self.power.start()
        if measured == 0:
            self._stop_power()  # the unprofiled steps are over
            self._start()
        before = run.comm.measurements()
        started = time.perf_counter()
        result = yield
        if measured < 0:
            self.warmup_results.append(result)
            if step > 0:
                self.plain_windows.append((started, time.perf_counter()))
        if measured >= 0:
            after = run.comm.measurements()
            self.results.append(result)
            self.comm.append({k: v - before.get(k, 0.0) for k, v in after.items()})
        if step + 1 == run.config.trainer.steps:
            self._stop()
        return result

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.profiler = torch.profiler.profile(activities=activities)
        self.profiler.__enter__()
        with record_function(MARKER):  # which profiler thread id the training loop's thread has
            pass

    def _stop_power(self) -> None:
        if self.power is not None:
            self.power.stop()

    def _stop(self) -> None:
        self._stop_power()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)

    @property
    def warmup_seconds(self) -> list[float]:
        return [r.seconds for r in self.warmup_results]

    def measured(self) -> MeasuredSteps:
        n = max(len(self.comm), 1)
        keys = sorted({k for c in self.comm for k in c})
        plain = self.warmup_results[1:]  # the first warm-up step compiles and warms up
        return MeasuredSteps(
            step_seconds=[r.seconds for r in self.results], tokens=[r.tokens for r in self.results],
            flops=[r.flops for r in self.results], comm_strategy=self.comm_name, world_size=self.world_size,
            comm_per_step={k: sum(c.get(k, 0.0) for c in self.comm) / n for k in keys}, peak_memory_bytes=self.peak,
            unprofiled_step_seconds=[r.seconds for r in plain], unprofiled_tokens=[r.tokens for r in plain],
            unprofiled_flops=[r.flops for r in plain],
            power=None if self.power is None else summarize_power(self.power.within(self.plain_windows)),
            power_failure=None if self.power is None else self.power.failure,
        )  # fmt: skip

    def breakdown(self) -> dict[str, float]:
        """Seconds per category over the measured steps (see the module doc)."""
        out = dict.fromkeys(ORDER, 0.0)
        if self.profiler is None:
            return out
        cuda = self.device.type == "cuda"
        events = self.profiler.events()
        wall = sum(r.seconds for r in self.results)
        if cuda:
            self.kernels = device_work(list(events))
            return kernel_breakdown(self.kernels, wall)
        loop = next((e.thread for e in events if e.name == MARKER), None)
        for event in events:
            if event.device_type != DeviceType.CPU or event.name == MARKER or event.thread != loop:
                continue  # the host time of the loop's thread (not the input prefetch thread's)
            us = event.self_cpu_time_total
            if not us:
                continue
            category, parent = None, event
            while parent is not None and category is None:
                category = SCOPES.get(parent.name)
                parent = parent.cpu_parent
            out[category or categorize(event.name)] += us / 1e6
        out["idle"] = max(0.0, wall - sum(v for k, v in out.items() if k != "idle"))
        return out


@contextmanager
def _registered(pm: GemPluginManager, plugin: object) -> Iterator[None]:
    name = pm.register(plugin, name="profile:step_probe")
    try:
        yield
    finally:
        pm.pm.unregister(name=name)


def measure_steps(config: RunConfig, pm: GemPluginManager, *, warmup: int, steps: int) -> StepProbe:
    """Train ``warmup + steps`` steps of ``config`` (in a scratch output directory) under a probe."""
    from gem_model.distributed import pick_device
    from gem_model.train.report import summaries_printed
    from gem_model.trainer import train

    scratch = tempfile.mkdtemp(prefix="gem-profile-steps-")
    try:
        run_config = config.model_copy(update={"trainer": config.trainer.model_copy(update={
            "steps": warmup + steps, "output_dir": scratch, "checkpoint_every": 0, "checkpoint_at_end": False,
            "eval_every": 0, "eval_at_end": False, "progress": False, "log_every": warmup + steps,
            "resume": False, "time_limit_s": None, "tensorboard": False,
        })})  # fmt: skip
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        probe = StepProbe(warmup, pick_device(config.trainer.device, local_rank))
        with _registered(pm, probe), summaries_printed(False):  # the profile reports the steps itself
            train(run_config, pm)
        return probe
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
