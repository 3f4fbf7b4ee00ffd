"""``ProfileContext.memory_fit``: the memory per rank the run would need under another precision
config (one step's activations measured under it, with the static bytes or the measured peak),
against the device's memory; and ``profile_context``, which plugins' subcommands get it from."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gem_model import api, testing
from gem_model.config import PrecisionConfig, ref
from gem_model.config_io import load_config
from gem_model.profiling.context import MeasuredSteps
from gem_model.profiling.memory import MemoryFit, activation_bytes, static_bytes
from gem_model.profiling.parts import make_context
from gem_model.profiling.report import ProfileSection
from gem_model.resolve import resolve_components

TINY = [*testing.INLINE_OVERRIDES]
BF16 = PrecisionConfig(scheme=ref("inline_bf16"))


@pytest.fixture
def made(pm, tmp_path: Path):
    torch.set_num_threads(1)
    config = load_config(None, TINY)
    return make_context(config, pm, resolve_components(config, pm), world=1, batches=1, out=tmp_path)


# two identical steps' LiveBytes peaks differ by a few KB (storages made once, at the first step):
# the activation parts are compared within 1 % of a step's peak
def close(peak: int) -> float:
    return 0.01 * peak


def _peak(ctx, parts, precision: PrecisionConfig) -> int:
    policy = ctx.config.activation.policy.name
    saved_peak = activation_bytes(ctx, parts.components, parts.first_batch, precision=precision, policies=[policy])
    return saved_peak[policy][1]


def test_without_a_measured_peak_it_is_the_static_bytes_and_the_steps_activation_peak(made):
    ctx, parts = made
    fit = ctx.memory_fit(BF16)
    fixed = static_bytes(ctx.config, parts.sizes, parts.plan)
    base = fixed["parameters"] + fixed["gradients"] + fixed["optimizer"]
    peak = _peak(ctx, parts, BF16)
    assert fit.need_bytes == pytest.approx(base + peak, abs=close(peak))
    assert fit.fits and fit.budget_bytes is not None and "available memory" in fit.budget  # a CPU: the host's
    # bf16 activations take half the bytes of float32 ones: the config's own precision needs more
    assert ctx.memory_fit(ctx.config.precision).need_bytes > fit.need_bytes


def test_with_a_measured_peak_it_is_that_peak_moved_by_the_difference_in_activations(made):
    ctx, parts = made
    ctx.measured = MeasuredSteps([0.1], [100], [1.0], "inline_comm", world_size=1, peak_memory_bytes=10**9)
    bf16, fp32 = _peak(ctx, parts, BF16), _peak(ctx, parts, ctx.config.precision)
    fit = ctx.memory_fit(BF16)
    assert fit.need_bytes == pytest.approx(10**9 + bf16 - fp32, abs=close(fp32)) and "measured peak 1 GB" in fit.basis
    # the memory section's own measurement of the configured run is the one used where there is one
    policy = ctx.config.activation.policy.name
    ctx.sections["memory"] = ProfileSection("memory", "m", summary={"activations": {policy: {"saved": 0, "peak": 5}}})
    assert ctx.memory_fit(BF16).need_bytes == pytest.approx(10**9 + bf16 - 5, abs=close(bf16))


def test_a_map_that_needs_more_than_the_device_has_does_not_fit_and_says_so():
    big = MemoryFit(200e9, 141e9, "the NVIDIA H200's 141 GB", "static 25 GB + activations 175 GB")
    assert not big.fits
    assert big.words() == "needs 200 GB per rank (static 25 GB + activations 175 GB), more than the NVIDIA H200's 141 GB"
    oom = MemoryFit(math.inf, 141e9, "the NVIDIA H200's 141 GB", "one step under this precision ran out of memory: X")
    assert not oom.fits and oom.words() == "does not fit: one step under this precision ran out of memory: X"
    assert MemoryFit(1e9, None, "unknown", "b").fits  # nothing to compare with: nothing refused


def test_a_plugin_gets_the_context_with_its_memory_check_from_the_api(pm):
    config = load_config(None, TINY)
    ctx = api.profile_context(config, pm)
    assert (ctx.world_size, ctx.dp_degree, ctx.device.type) == (1, 1, "cpu")
    assert ctx.fit_memory is not None and ctx.build_model is not None and ctx.measured is None
