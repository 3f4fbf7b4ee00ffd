"""``gem-train tune``: a coordinate search by short real runs on the tiny inline config; it stops
within its budget, records failing candidates, and the config it writes trains."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from gem_model import testing
from gem_model.cli import main
from gem_model.config_io import dump, load_config
from gem_model.profiling.report import ProfileReport, ProfileSection
from gem_model.trainer import train
from gem_model.tune.search import CutOff, dimensions, measure, tune, with_overrides
from gem_model.tune.skips import pruned, slower_here, wider_gemms

TINY = [*testing.INLINE_OVERRIDES]


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_tune_tries_every_dimension_and_its_config_trains(monkeypatch, tmp_path: Path, capsys, pm):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    assert main(["tune", *TINY, "--budget", "5", "--steps", "3", "--out", str(tmp_path / "tune")]) == 0
    result = json.loads((tmp_path / "tune" / "tune.json").read_text())
    tried = {(c["dimension"], json.dumps(c["overrides"])) for c in result["candidates"]}
    # the inline registries: one alternative kernel, scheme and planner each; one policy; one dp rank
    assert tried == {
        ("attention kernel", '{"kernels.jagged_attention": "poison"}'),
        ("precision", '{"precision.scheme": "inline_bf16"}'),
        ("planner", '{"parallel.planner": "inline_replicated"}'),
    }
    poison = next(c for c in result["candidates"] if c["dimension"] == "attention kernel")
    assert "NonFinite" in poison["error"] and not poison["chosen"]  # a NaN run is recorded, never chosen
    assert not result["stopped_by_budget"] and result["seconds"] <= 5 * 60 and result["complete"]
    out = capsys.readouterr().out
    assert "gem-train tune:" in out and "== summary" not in out  # one table row a candidate, no run summaries
    chosen = load_config(tmp_path / "tune" / "tuned.yaml", ["trainer.steps=2", f"trainer.output_dir={tmp_path}/run"])
    assert chosen.kernels.jagged_attention.name == "loop"
    summary = train(chosen, pm)
    assert summary.steps == 2 and math.isfinite(summary.last_loss)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_tune_stops_within_a_budget_that_fits_only_the_starting_config(pm, monkeypatch):
    screen = _Terminal()
    monkeypatch.setattr(sys, "stderr", screen)  # a terminal: tune shows its live progress
    config = load_config(None, TINY)
    result = tune(config, pm, budget_s=1e-3, steps=2)
    assert result.stopped_by_budget and result.best == config
    # every alternative is in the table, as not measured for lack of budget
    assert {c.dimension for c in result.candidates} == {"attention kernel", "precision", "planner"}
    assert all(c.skipped and "of the budget left" in c.skipped and c.tokens_per_s is None and not c.chosen
               for c in result.candidates)  # fmt: skip
    assert result.baseline.tokens_per_s and result.baseline.tokens_per_s > 0
    assert "tune" in screen.getvalue() and "/1" in screen.getvalue()  # seconds spent of a 1 s budget


def test_with_overrides_replaces_a_whole_precision_block():
    config = load_config(None, [*TINY, "precision.overrides={a: inline_bf16}"])
    got = with_overrides(config, {"precision": {"scheme": "inline_bf16", "exclude": ["x"]}, "data.balancer": "round_robin"})
    assert got.precision.scheme.name == "inline_bf16" and got.precision.overrides == {} and got.precision.exclude == ["x"]


def test_bad_budget_exits_2(monkeypatch, capsys):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    assert main(["tune", *TINY, "--budget", "0"]) == 2
    assert "--budget" in capsys.readouterr().err
    assert main(["tune", *TINY, "--budget", "1", "--repeats", "0"]) == 2
    assert "--repeats" in capsys.readouterr().err


def test_a_profile_with_a_numerics_section_gives_the_per_layer_map(pm):
    block = "precision:\n  scheme: inline_bf16\n  overrides: {task_head.0: inline_fp32}\n  min_dim: 0\n"
    numerics = ProfileSection("numerics", "numerics", summary={"precision_yaml": block})
    report = ProfileReport("gem-tiny", "cpu", "-", "-", [numerics])
    dims = dict(dimensions(load_config(None, TINY), pm, report))
    schemes = [{"precision.scheme": n} for n in pm.precision_schemes.names()]
    # the map first, then every scheme as the whole model's (a cheaper map may not be the fastest one)
    assert dims["precision"] == [{"precision": {"scheme": "inline_bf16", "overrides": {"task_head.0": "inline_fp32"},
                                                "min_dim": 0}}, *schemes]  # fmt: skip
    assert dims["balancer"] == []  # one data-parallel rank: every balancer splits alike
    cut = ProfileSection("numerics", "numerics: cut off", summary={"status": "timed_out", "seconds": 1.0, "error": "-"})
    dims = dict(dimensions(load_config(None, TINY), pm, ProfileReport("gem-tiny", "cpu", "-", "-", [cut])))
    assert dims["precision"] == [{"precision.scheme": n} for n in pm.precision_schemes.names()]  # no map: every scheme


def test_tune_refuses_several_processes(monkeypatch, capsys):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["tune", *TINY, "--budget", "1"]) == 2
    assert "one process" in capsys.readouterr().err


def test_tune_profiles_what_it_reads_when_the_profile_is_missing_and_compares_configs(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    prof = tmp_path / "prof"
    assert main(["tune", *TINY, "--budget", "5", "--steps", "2", "--profile", str(prof), "--out", str(tmp_path / "t")]) == 0
    assert [s.name for s in ProfileReport.from_json((prof / "profile.json").read_text()).sections] == ["memory"]
    assert "profiling memory into it first" in capsys.readouterr().out
    other = tmp_path / "other.yaml"
    other.write_text(dump(load_config(None, [*TINY, "precision.scheme=inline_bf16"])))  # as tuned.yaml is
    assert main(["tune", *TINY, "--steps", "2", "--compare", str(other), "--out", str(tmp_path / "t")]) == 0
    written = json.loads((tmp_path / "t" / "compare.json").read_text())
    runs, means = written["runs"], written["means"]
    base = "(the default config)"
    # A, B, B, A: neither config pays alone for the process's first run (kernel compilation, tuning)
    assert [r["overrides"]["config"] for r in runs] == [base, str(other), str(other), base]
    assert all(r["tokens_per_s"] > 0 and math.isfinite(r["last_loss"]) for r in runs)
    assert means[base]["tokens_per_s"] == pytest.approx((runs[0]["tokens_per_s"] + runs[3]["tokens_per_s"]) / 2)
    assert means[str(other)]["runs"] == 2
    assert "x the tokens/s of" in capsys.readouterr().out


def test_activation_policies_are_not_measured_when_the_profile_says_the_config_fits():
    config = load_config(None, TINY)
    policy = config.activation.policy.name
    memory = ProfileSection("memory", "memory", summary={
        "parameters": 1e9, "gradients": 1e9, "optimizer": 2e9, "measured_peak": None,
        "activations": {policy: {"saved": 1e9, "peak": 2e9}}})  # fmt: skip
    report = ProfileReport("gem-tiny", "cpu", "-", "-", [memory])
    why = pruned("activation policy", config, report, memory_gb=5.0)  # 1 + 1 + 2 + 1 GB fits 5 GB
    assert why is not None and "5.0 GB" in why and "fits --memory-gb 5" in why
    assert pruned("activation policy", config, report, memory_gb=4.9) is None  # it does not fit: measure them
    assert pruned("activation policy", config, report, memory_gb=None) is None
    assert pruned("precision", config, report, memory_gb=5.0) is None
    memory.summary["measured_peak"] = 6e9  # the allocator's peak wins over the estimate
    assert pruned("activation policy", config, report, memory_gb=5.0) is None


def test_dimensions_left_out_are_recorded_as_not_searched(pm, monkeypatch, capsys):
    config = load_config(None, TINY)
    result = tune(config, pm, budget_s=60, steps=2, only=("precision",))
    searched = [c for c in result.candidates if c.skipped is None]
    assert [c.dimension for c in searched] == ["precision"] and searched[0].tokens_per_s > 0
    assert {c.dimension: c.skipped for c in result.candidates if c.skipped} == {
        "attention kernel": "not searched (--dimensions)", "planner": "not searched (--dimensions)"}  # fmt: skip
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    assert main(["tune", *TINY, "--budget", "1", "--dimensions", "precision,kernels"]) == 2
    err = capsys.readouterr().err
    assert "kernels" in err and "kernel, precision, activation, balancer, planner, compile" in err


def test_a_candidate_stopped_by_its_time_limit_is_an_error_not_a_figure(pm):
    config = load_config(None, TINY)
    with pytest.raises(CutOff, match="after 1 of 3 steps"):
        measure(config, pm, 3, time_limit_s=1e-9)  # the trainer stops after the step that passed the limit
    tps, peak, loss = measure(config, pm, 2, time_limit_s=600.0)  # a limit not reached changes nothing
    assert tps > 0 and peak is None and math.isfinite(loss)


def test_tune_reports_the_result_so_far_after_every_candidate(pm):
    seen = []

    def record(so_far):
        seen.append((so_far.complete, sum(c.skipped is None for c in so_far.candidates)))

    result = tune(load_config(None, TINY), pm, budget_s=60, steps=2, only=("precision", "planner"), on_candidate=record)
    measured = [c for c in result.candidates if c.skipped is None]
    # once after the baseline, then once per measured candidate, each with what was tried so far
    assert [n for _, n in seen] == [0, *range(1, len(measured) + 1)] and not any(done for done, _ in seen)
    assert result.complete


def test_on_a_gpu_schemes_with_wider_gemms_are_not_measured(pm):
    config = load_config(None, [*TINY, "precision.scheme=inline_bf16"])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    why = wider_gemms(config, {"precision.scheme": "inline_fp32"}, pm, cuda)
    assert why is not None and "float32" in why and "inline_bf16" in why
    assert wider_gemms(config, {"precision.scheme": "inline_fp32"}, pm, cpu) is None  # a CPU may run fp32 faster
    assert wider_gemms(config, {"precision.scheme": "inline_bf16"}, pm, cuda) is None
    assert wider_gemms(load_config(None, TINY), {"precision.scheme": "inline_bf16"}, pm, cuda) is None
    assert wider_gemms(config, {"kernels.jagged_attention": "loop"}, pm, cuda) is None


def test_schemes_the_profile_measured_emulated_or_slower_here_are_not_measured():
    config = load_config(None, TINY)  # inline_fp32
    rates = {"inline_bf16": {"emulated": True, "why": "no bf16 here"}, "slow": {"emulated": False},
             "fast": {"emulated": False}}  # fmt: skip
    numerics = ProfileSection("numerics", "n", summary={"rates": {"schemes": rates},
                                                         "scheme_gain_s_per_step": {"slow": -0.002, "fast": 0.001}})  # fmt: skip
    profiled = {"precision": {"scheme": {"name": "inline_fp32", "options": {}}}}
    report = ProfileReport("gem-tiny", "cpu", "-", "-", [numerics], config=profiled)
    cpu = torch.device("cpu")

    def why(name: str, r: ProfileReport = report) -> str | None:
        return slower_here(config, {"precision.scheme": name}, r, cpu)

    assert why("inline_bf16") == "not measured: inline_bf16 runs emulated on this device (the profile's numerics section: no bf16 here)"
    assert why("slow") == "not measured: the profile's numerics section measured slow's linears slower here than inline_fp32's (2.00 ms a step more)"
    assert why("fast") is None and why("unmeasured") is None
    elsewhere = ProfileReport("gem-tiny", "NVIDIA H200", "-", "-", [numerics], config=profiled)
    assert why("slow", elsewhere) is None  # another device's rates say nothing here
    other = ProfileReport("gem-tiny", "cpu", "-", "-", [numerics], config={"precision": {"scheme": {"name": "x"}}})
    assert why("slow", other) is None  # nor rates against another configured scheme
    assert slower_here(config, {"kernels.jagged_attention": "loop"}, report, cpu) is None


def test_a_warm_up_run_comes_first_and_each_config_runs_repeats_times(pm, monkeypatch):
    import gem_model.tune.search as search

    runs = []
    real = search.measure_once

    def counted(config, *args, **kwargs):
        runs.append(config.precision.scheme.name)
        return real(config, *args, **kwargs)

    monkeypatch.setattr(search, "measure_once", counted)
    result = tune(load_config(None, TINY), pm, budget_s=60, steps=2, only=("precision",), repeats=2)
    measured = [c for c in result.candidates if c.skipped is None]
    assert len(measured) == 1 and result.warmup_seconds > 0
    # the uncounted warm-up, the baseline twice, the candidate twice
    assert runs == ["inline_fp32", "inline_fp32", "inline_fp32", "inline_bf16", "inline_bf16"]
    runs.clear()
    tune(load_config(None, TINY), pm, budget_s=60, steps=2, only=("precision",), warmup=False)
    assert runs == ["inline_fp32", "inline_bf16"]


def test_compile_is_a_dimension_on_a_gpu_only(pm, monkeypatch):
    import gem_model.tune.search as search

    config = load_config(None, TINY)
    assert dict(dimensions(config, pm, None))["compile"] == []  # the CPU: inductor's C++ build takes minutes
    monkeypatch.setattr(search, "pick_device", lambda *_: torch.device("cuda"))
    gpu = dict(dimensions(config.model_copy(update={"trainer": config.trainer.model_copy(update={"device": "cpu"})}),
                          pm, None))  # fmt: skip
    assert gpu["compile"] == [{"trainer.compile": True}]  # the other setting than the config's


def test_a_planner_that_needs_a_process_group_is_not_tried_in_a_plain_process(pm):
    from typing import ClassVar

    from gem_model import hookimpl

    class Grouped(testing.Replicated):
        name: ClassVar[str] = "inline_grouped"
        needs_process_group: ClassVar[bool] = True

    class Plugin:
        @hookimpl
        def gem_register_parallel_planners(self):
            return [Grouped]

    pm.register(Plugin())
    planners = dict(dimensions(load_config(None, TINY), pm, None))["planner"]
    assert {"parallel.planner": "inline_replicated"} in planners
    assert {"parallel.planner": "inline_grouped"} not in planners  # it would only record an error
