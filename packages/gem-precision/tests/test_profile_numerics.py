"""gem-precision's profile hooks: the ``numerics`` section from the probe, and the ``precision``
subcommand reaching gem-train through ``gem_profile_commands``."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gem_model import testing
from gem_model.config_io import load_config
from gem_model.plugins import GemPluginManager
from gem_model.profiling.context import ProfileContext
from gem_model.profiling.shared_model import initial_model
from gem_precision import plugin
from gem_precision.probe import ProbeOptions, probe_precision

TINY = [*testing.INLINE_OVERRIDES, "precision.scheme=fp32"]


@pytest.fixture
def pm() -> GemPluginManager:
    return GemPluginManager(autoload=False, plugins=[testing, plugin])


def test_the_plugin_contributes_the_numerics_section_and_the_command(pm):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        config, cpu = load_config(None, TINY), torch.device("cpu")
        ctx = ProfileContext(config, pm, cpu, 1, 1, 1, Path("."), build_model=lambda: initial_model(config, pm, cpu))
        sections = [s for group in pm.call("gem_profile_sections", profile=ctx) for s in group]
    finally:
        torch.set_num_threads(before)
    assert [s.name for s in sections] == ["numerics"]
    numerics = sections[0]
    schemes = numerics.summary["schemes"]
    assert schemes[:5] == ["mxfp8", "fp8_rowwise", "fp8_tensorwise", "bf16", "fp32"]  # cheapest first
    assert set(schemes[5:]) == {"inline_fp32", "inline_bf16"}
    column = numerics.tables[0].columns.index("inline_bf16")
    rows = numerics.tables[0].rows
    assert len(rows) == 13 and all(0 < r[column] < 1e-2 for r in rows)  # bf16 keeps 8 bits
    commands = [c for group in pm.call("gem_profile_commands") for c in group]
    assert [c.name for c in commands] == ["precision"]
    # what each candidate's linears cost on this CPU, measured: the fp8 and MX schemes are emulated
    # here, so they are never recommended, whatever the clock said
    rates = {r[0]: r for r in numerics.tables[1].rows}
    assert list(rates) == [*schemes, "as is"]
    for name, (_, backend, why, gemm, linear, outside, gain, verdict) in rates.items():
        assert gemm > 0 and linear > 0 and outside.endswith(" %") and "ms/step" in gain, name
        emulated = name in ("mxfp8", "fp8_rowwise", "fp8_tensorwise")
        assert (backend == "emulated") is emulated and ("no fp8 tensor cores" in why) is emulated, name
        assert not emulated or verdict == "not recommended: emulated here x13", name
        measured = numerics.summary["rates"]["schemes"][name]
        assert measured["linear_tflops"] == linear and len(measured["shapes"]) == len(numerics.summary["rates"]["schemes"]["bf16"]["shapes"])
    assert not {"mxfp8", "fp8_rowwise", "fp8_tensorwise"} & set(numerics.summary["recommended"].values())


def test_the_sections_probe_recommends_what_the_full_probe_does_with_fewer_losses(pm):
    config = load_config(None, TINY)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cpu = torch.device("cpu")
        ctx = ProfileContext(config, pm, cpu, 1, 1, 1, Path("."), build_model=lambda: initial_model(config, pm, cpu))
        shared = ctx.model()
        full = probe_precision(config, pm, ProbeOptions(batches=1, max_samples=8), model=shared)
        fast = probe_precision(config, pm, ProbeOptions(batches=1, max_samples=8, loss_until_pass=True), model=shared)
    finally:
        torch.set_num_threads(before)
    assert shared.training  # the shared model is left as it was
    assert fast.recommendations() == full.recommendations() and fast.baseline_loss == full.baseline_loss
    for f, m in zip(full.modules, fast.modules, strict=True):
        order = list(fast.schemes)
        after = order[order.index(m.recommended) + 1:] if m.recommended else []
        for s in order:  # the relative errors are the same; the loss only where it decides
            assert m.measures[s].rel_err == pytest.approx(f.measures[s].rel_err, nan_ok=True)
        assert all(math.isnan(m.measures[s].loss_delta) for s in after if m.measures[s].rel_err > 0)
    measured = sum(not math.isnan(x.loss_delta) for m in fast.modules for x in m.measures.values())
    assert measured < sum(not math.isnan(x.loss_delta) for m in full.modules for x in m.measures.values())
