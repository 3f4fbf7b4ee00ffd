"""Honest numbers: no `nan` in a summary, the summary names the pipeline and the callbacks, the
profile's rates come from unprofiled steps, recommendations only of what pays on the device, and a
damaged profile.json is refused naming the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from gem_model.cli import main
from gem_model.config_io import load_config
from gem_model.profiling.context import MeasuredSteps, ProfileContext
from gem_model.profiling.mfu import mfu_section
from gem_model.profiling.report import ProfileReport, ProfileSection
from gem_model.profiling.step_time import ORDER, step_time_section
from gem_model.results import RunSummary
from gem_model.trainer import train


def test_a_run_with_nothing_left_to_train_says_so_without_nan(pm, tiny_overrides, capsys):
    config = load_config(None, [*tiny_overrides, "trainer.steps=2", "callbacks=[{name: inline_recorder}]"])
    train(config, pm)
    first = capsys.readouterr().out
    assert "pipeline" in first and "sequential" in first  # the summary names the pipeline ...
    assert re.search(r"callbacks +inline_recorder", first)  # ... and the callbacks
    train(config, pm)
    out = capsys.readouterr().out
    assert "nan" not in out.lower()
    assert re.search(r"trained +nothing: the run was at step 2 already \(raise trainer.steps to train on\)", out)
    assert "samples / s" not in out and "MFU" not in out  # no rate of nothing


def test_a_run_whose_every_step_was_skipped_shows_no_nan():
    nan = float("nan")
    summary = RunSummary("r", 3, nan, nan, 1.0, 10.0, 100.0, 0.01, 1e12, "x", 1, "cpu", {}, trained_steps=3)
    rows = dict(summary.section().rows)
    assert rows["loss (first -> last)"] == "none: no step had a finite loss"


def _ctx(pm, measured: MeasuredSteps) -> ProfileContext:
    config = load_config(None, ["precision.scheme=inline_fp32"])
    return ProfileContext(config, pm, torch.device("cpu"), 1, 1, 1, Path("."), measured=measured)


def test_the_mfu_comes_from_the_unprofiled_steps(pm):
    # under the profiler a CPU step took 3.8 s; without it 0.1 s (the tiny-config profile)
    measured = MeasuredSteps([3.8, 3.8], [1000, 1000], [1e9, 1e9], "inline_comm", unprofiled_step_seconds=[0.1],
                             unprofiled_tokens=[1000], unprofiled_flops=[1e9])  # fmt: skip
    section = mfu_section(_ctx(pm, measured))
    assert section.summary["tokens_per_s"] == pytest.approx(10_000)  # 1000 tokens in 0.1 s, not in 3.8 s
    assert section.summary["unprofiled"] and "from 1 unprofiled warm-up step(s)" in section.notes[0]
    without = mfu_section(_ctx(pm, MeasuredSteps([3.8], [1000], [1e9], "inline_comm")))
    assert "torch.profiler's own host cost is in their time" in without.notes[0]
    assert not any("tuned or compiled" in n for n in section.notes)


def test_the_mfu_says_when_its_unprofiled_steps_were_uneven(pm):
    # the H100's big config with --warmup 5: one step at 157 ms, the others tuning Triton kernels
    tuning = MeasuredSteps([0.25], [1000], [1e9], "inline_comm", unprofiled_step_seconds=[0.2, 2.0, 1.0, 0.2],
                           unprofiled_tokens=[1000] * 4, unprofiled_flops=[1e12] * 4)  # fmt: skip
    notes = mfu_section(_ctx(pm, tuning)).notes
    assert notes[1] == ("the unprofiled steps ran 0.5 to 5 TFLOP/s: some of them tuned or compiled kernels, so "
                        "these rates are low; more --warmup steps give steadier ones")  # fmt: skip
    # batches twice the size take twice as long: the same rate, no note
    sizes = MeasuredSteps([0.25], [1000], [1e9], "inline_comm", unprofiled_step_seconds=[0.1, 0.2, 0.15],
                          unprofiled_tokens=[500, 1000, 750], unprofiled_flops=[1e12, 2e12, 1.5e12])  # fmt: skip
    assert not any("tuned or compiled" in n for n in mfu_section(_ctx(pm, sizes)).notes)


class _Probe:
    """What the step-time section reads of a probe: a pointwise-heavy breakdown."""

    kernels: list = []
    warmup_seconds = [1.0, 0.1]

    def breakdown(self) -> dict[str, float]:
        return {k: (3.0 if k == "pointwise" else 0.1) for k in ORDER}

    def measured(self) -> MeasuredSteps:
        return MeasuredSteps([3.6], [1000], [1e9], "inline_comm", unprofiled_step_seconds=[0.1],
                             unprofiled_tokens=[1000], unprofiled_flops=[1e9])  # fmt: skip


def test_the_step_time_says_it_includes_the_profiler_and_recommends_no_compile_on_a_cpu(pm):
    section = step_time_section(_ctx(pm, _Probe().measured()), _Probe())  # type: ignore[arg-type]
    assert "under torch.profiler" in section.title
    assert "3600.0 ms under it and 100.0 ms without it" in section.notes[0]
    assert not [r for r in section.recommendations if "compile" in r.action]  # it pays on a GPU, not here
    cuda = _ctx(pm, _Probe().measured())
    cuda.device = torch.device("cuda")
    assert [r for r in step_time_section(cuda, _Probe()).recommendations if "compile" in r.action]  # type: ignore[arg-type]


def test_report_names_the_missing_field(tmp_path, capsys):
    report = ProfileReport("c", "cpu", "now", "cmd", [ProfileSection("memory", "memory per rank")])
    data = json.loads(report.to_json())
    del data["sections"][0]["title"]
    (tmp_path / "profile.json").write_text(json.dumps(data))
    assert main(["report", str(tmp_path)]) == 2
    assert "profile.json: sections[0] ('memory') has no field 'title'" in capsys.readouterr().err
    data["sections"][0]["title"] = "memory per rank"
    del data["device"]
    (tmp_path / "profile.json").write_text(json.dumps(data))
    assert main(["report", str(tmp_path)]) == 2
    assert "profile.json has no field 'device'" in capsys.readouterr().err


def _capped(share: float) -> dict:
    return {"samples": 20, "watts_median": 692.0, "watts_mean": 650.0, "limit_watts": 700.0, "sm_mhz_median": 1695.0,
            "sm_mhz_min": 1470.0, "sm_mhz_max": 1980.0, "power_capped_share": share}  # fmt: skip


def _with_power(power: dict | None, failure: str | None = None) -> MeasuredSteps:
    return MeasuredSteps([3.8], [1000], [1e9], "inline_comm", unprofiled_step_seconds=[0.1], unprofiled_tokens=[1000],
                         unprofiled_flops=[1e9], power=power, power_failure=failure)  # fmt: skip


def test_the_mfu_says_when_the_gpu_ran_at_its_power_cap(pm):
    capped = mfu_section(_ctx(pm, _with_power(_capped(0.97))))
    rows = dict((r[0], r[1]) for r in capped.tables[0].rows)
    assert rows["SM clock in the unprofiled steps, MHz"] == "1695 (1470-1980)"
    assert rows["power draw, W"] == "692 of 700" and rows["samples at the power cap"] == "97.00 %"
    assert capped.summary["power"]["power_capped_share"] == 0.97
    # the unprofiled step took 0.1 s at a mean 650 W: 65 J
    assert rows["energy a step, J (mean power x mean step time)"] == "65.0" and capped.summary["joules_per_step"] == 65.0
    assert any(n.startswith("the GPU ran at its power cap in 97 % of 20 samples (SM clock 1695 MHz)") for n in capped.notes)
    # sampled but mostly below the cap (a short profile whose warm-up steps tune kernels, on the H100:
    # 51 %): the figures, no warning
    free = mfu_section(_ctx(pm, _with_power(_capped(0.51))))
    assert "samples at the power cap" in dict((r[0], r[1]) for r in free.tables[0].rows)
    assert not any("power cap in" in n for n in free.notes)
    # tried and failed: the reason; not tried (a CPU): nothing about power at all
    failed = mfu_section(_ctx(pm, _with_power(None, "nvidia-smi did not start: [Errno 2] No such file")))
    assert "power and clock not sampled: nvidia-smi did not start: [Errno 2] No such file" in failed.notes
    cpu = mfu_section(_ctx(pm, _with_power(None)))
    assert cpu.summary["power"] is None and not any("power" in n for n in cpu.notes)
    assert not any("power" in str(r[0]) or "clock" in str(r[0]) for r in cpu.tables[0].rows)


def test_the_step_probe_keeps_the_unprofiled_steps_windows_and_samples_no_cpu(pm, tiny_overrides):
    from gem_model.profiling.step_probe import measure_steps

    config = load_config(None, tiny_overrides)
    probe = measure_steps(config, pm, warmup=3, steps=1)
    windows = probe.plain_windows  # the warm-up steps after the first, which the MFU's rates come from
    assert len(windows) == 2 and all(a < b for a, b in windows) and windows[0][1] <= windows[1][0]
    for (a, b), result in zip(windows, probe.warmup_results[1:], strict=True):
        assert 0 < b - a <= result.seconds * 1.1 + 0.01  # the step's own span, within what the trainer timed
    measured = probe.measured()
    assert probe.power is None and measured.power is None and measured.power_failure is None  # no GPU here
