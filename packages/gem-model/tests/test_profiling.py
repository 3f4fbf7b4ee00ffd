"""``gem-train profile`` / ``report``: every section on the tiny inline config, the numbers against
hand-computed cases, the outputs (JSON, PNGs of the expected size, HTML) and the profile hooks."""

from __future__ import annotations

import io
import json
import struct
import sys
from pathlib import Path

import pytest
import torch

from gem_model import testing
from gem_model.cli import main
from gem_model.components import PrecisionScheme
from gem_model.config_io import load_config
from gem_model.data.balance import RoundRobinBalancer
from gem_model.model.gem import GemModel
from gem_model.plan import DensePlacement, Plan, TablePlacement
from gem_model.profiling import balance, comm, mfu, sequences
from gem_model.profiling.memory import LiveBytes, static_bytes
from gem_model.profiling.plots import HEIGHT, WIDTH
from gem_model.profiling.render import load_report
from gem_model.profiling.report import ProfileReport
from gem_model.resolve import resolve_components
from gem_model.train import metrics
from gem_model.train.prepare import offline_plan

TINY = [*testing.INLINE_OVERRIDES]
CORE_SECTIONS = ["sequences", "balance", "step_time", "memory", "communication"]

# ------------------------------------------------------------------------------- hand-computed cases


def test_histogram_percentiles_and_padding_by_hand():
    lengths = torch.tensor([1, 2, 2, 9])
    hist = sequences.length_histogram(lengths, bins=5)  # width ceil(10 / 5) = 2: [0,2) [2,4) ... [8,10)
    assert (hist.width, hist.counts, hist.edges) == (2, [1, 2, 0, 0, 1], [0, 2, 4, 6, 8, 10])
    pct = sequences.percentiles(lengths, (0.5, 1.0))
    assert pct == {"p50": 2.0, "p100": 9.0}  # linear interpolation: the mean of the two middle values
    assert sequences.percentiles(torch.tensor([0, 10]), (0.9,)) == {"p90": pytest.approx(9.0)}
    # batch [1, 2] padded to 2: 4 slots, 3 real; batch [2, 9] to 9: 18 slots, 11 real -> 14 real of 22
    assert sequences.padding_waste_to_max([torch.tensor([1, 2]), torch.tensor([2, 9])]) == pytest.approx(1 - 14 / 22)
    edges = sequences.bucket_edges(9)
    assert edges == [1, 2, 4, 8, 9]
    # 1 -> 1, 2 -> 2, 2 -> 2, 9 -> 9: no waste; 3 -> 4 and 5 -> 8: 8 real of 12
    assert sequences.padding_waste_to_buckets(lengths, edges) == 0.0
    assert sequences.padding_waste_to_buckets(torch.tensor([3, 5]), edges) == pytest.approx(1 - 8 / 12)
    stats = sequences.token_stats([torch.tensor([1, 3]), torch.tensor([6, 2])])  # tokens 4 and 8
    assert stats["tokens_per_batch_mean"] == 6.0 and stats["tokens_per_batch_var"] == 4.0
    assert stats["tokens_per_batch_cv"] == pytest.approx(2 / 6)


def test_rank_loads_and_imbalance_by_hand():
    history = [torch.tensor([4, 1, 2, 1]), torch.tensor([1, 1, 1, 1])]
    per_step = balance.rank_loads(RoundRobinBalancer(), history, 2, lambda n: float(n.sum()))
    assert per_step == [[6.0, 2.0], [2.0, 2.0]]  # round robin: samples 0, 2 | 1, 3
    assert balance.imbalance(per_step) == pytest.approx((6 / 4 + 1.0) / 2)


def test_comm_bytes_per_dim_by_hand():
    plan = Plan(
        "p", {"degrees": {"dp_replicate": 4}, "world_size": 4},
        tables={"item": TablePlacement("row_wise", [0, 1, 2, 3], rows=100, dim=8),
                "t_x": TablePlacement("data_parallel", [0, 1, 2, 3], rows=10, dim=8)},
        dense={"tower": DensePlacement("replicated", ["dp_replicate"], 1000)},
    )  # fmt: skip
    got = comm.bytes_per_dim(plan, {"item": 10.0, "t_x": 3.0})
    assert got == {"dense dp_replicate": 2 * 3 / 4 * 4 * 1000, "embedding all-to-all": 2 * 3 / 4 * 4 * 8 * 10}


def test_static_memory_of_a_tiny_model_by_hand(pm):
    config = load_config(None, TINY)
    c = resolve_components(config, pm)
    plan = offline_plan(config, c, world_size=1)
    model = GemModel(config.model, c.source.feature_spec(), attention=c.attention, norm_gate=c.norm_gate,
                     next_item_loss=c.next_item_loss)  # fmt: skip
    dense = sum(p.numel() for _, p in model.dense_named_parameters()) * 4
    rows = sum(t.num_embeddings for t in model.table_configs())
    table = sum(t.num_embeddings * t.embedding_dim for t in model.table_configs()) * 4
    got = static_bytes(config, model, plan)
    # unsharded tables, unfused: a full table gradient; rowwise adagrad keeps one float per row
    assert got["parameters"] == dense + table and got["gradients"] == dense + table
    assert got["optimizer"] == 2 * dense + 4 * rows
    adam = static_bytes(load_config(None, [*TINY, "trainer.sparse_optimizer=adam"]), model, plan)
    assert adam["optimizer"] == 2 * dense + 2 * table


def test_live_bytes_counts_storages_while_they_live():
    with LiveBytes() as meter:
        a = torch.ones(100)  # 400 B
        b = a[10:]  # a view: no new storage
        c = torch.zeros(50, dtype=torch.float64)  # 400 B
        assert meter.live == 800 and b.numel() == 90
        del c
        assert meter.live == 400
        d = a * 2  # 400 B
        del d
    assert (meter.live, meter.peak) == (400, 800)


def test_op_names_fall_into_their_categories():
    from gem_model.profiling.step_time import categorize

    cases = {"aten::addmm": "gemm", "aten::mm": "gemm", "aten::bmm": "gemm", "nccl:all_reduce": "communication",
             "gloo:all_to_all": "communication", "aten::embedding_dense_backward": "embeddings",
             "fbgemm::split_embedding_codegen_lookup": "embeddings", "aten::logsumexp": "loss",
             "aten::binary_cross_entropy_with_logits": "loss", "aten::add_": "pointwise",
             "aten::broadcast_tensors": "pointwise", "aten::_efficient_attention_forward": "attention"}  # fmt: skip
    assert {name: categorize(name) for name in cases} == cases


def test_device_kernels_fall_into_their_categories_and_idle_is_the_gap_between_them():
    """CUDA: each kernel by its own name (the H200 profile's kernels), idle = wall - union of kernels."""
    from gem_model.profiling.step_time import busy_seconds, categorize_kernel, kernel_breakdown

    cases = {"query_major_kernel": "attention", "key_major_kernel": "attention",
             "nvjet_sm90_tst_256x160_64x4_1x2_h_bz_coopA_NNT": "gemm",
             "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT": "gemm",
             "void split_embedding_nobag_codegen_forward_unweighted_kernel<float, float>": "embeddings",
             "ncclDevKernel_AllReduce_Sum_f32_RING_LL": "communication", "triton_poi_fused_silu_3": "pointwise",
             "_norm_gate_bwd": "pointwise", "_fp8_stats_kernel": "pointwise",
             "void at::native::vectorized_elementwise_kernel<8, at::native::silu_backward_kernel>": "pointwise",
             # the Gluon attention's and the epilogue GEMM's kernels, by their whole names (the H200's
             # 2026-12-05 profile had them as pointwise)
             "dkdv_kernel": "attention", "forward_kernel": "attention", "dq_ws_kernel": "attention",
             "_linear_epilogue": "gemm",
             # the stored dq's pass (the H100's 2026-12-07 profile had it as pointwise)
             "_dq_stored_kernel": "attention",
             # a part of a name is not enough for the plain names
             "void my_forward_kernel<float>": "pointwise"}  # fmt: skip
    assert {name: categorize_kernel(name) for name in cases} == cases
    assert busy_seconds([(0, 10), (5, 20), (30, 40), (32, 35)]) == 30e-6  # overlapping streams count once
    kernels = [("query_major_kernel", 0.0, 400.0), ("nvjet_sm90_x", 300.0, 700.0), ("triton_poi_fused_add", 800.0, 900.0)]
    out = kernel_breakdown(kernels, wall_s=1e-3)
    assert out["attention"] == 400e-6 and out["gemm"] == 400e-6 and out["pointwise"] == 100e-6
    assert abs(out["idle"] - (1e-3 - 800e-6)) < 1e-12  # 100 us between the gemm and the add, 100 us after


def test_idle_without_the_profiler_is_a_warm_step_less_the_device_work():
    from gem_model.profiling.step_time import idle_without_profiler

    # the first warm-up step compiles; the faster of the last two is the unprofiled step
    assert idle_without_profiler([9.0, 0.30, 0.26], busy_per_step=0.236) == (0.26, pytest.approx(0.024))
    assert idle_without_profiler([0.2], busy_per_step=0.25) == (0.2, 0.0)  # never below zero


def test_only_kernels_copies_and_memsets_are_device_work():
    """The profiler mirrors its annotations (ProfilerStep#N, module and record_function ranges) on the
    device timeline; they span many kernels and must not count as kernels."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    from gem_model.profiling.step_time import device_work, top_kernels

    def event(name, start, end, device=DeviceType.CUDA, **kw):
        return FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=end, device_type=device, **kw)

    events = [
        event("query_major_kernel", 0, 400, activity_type="kernel"),
        event("query_major_kernel", 500, 900, activity_type="kernel"),
        event("Memcpy HtoD (Pinned -> Device)", 900, 950, activity_type="gpu_memcpy"),
        event("ProfilerStep#4", 0, 1000, is_user_annotation=True),
        event("DistributedDataParallel.forward", 0, 800, activity_type="gpu_user_annotation"),
        event("aten::mm", 0, 300, device=DeviceType.CPU),
    ]
    work = device_work(events)
    assert [name for name, _, _ in work] == ["query_major_kernel", "query_major_kernel", "Memcpy HtoD (Pinned -> Device)"]
    rows = top_kernels(work, steps=2)
    assert rows[0] == ["query_major_kernel", "attention", 0.4, 1.0]  # 800 us over 2 steps, one call each
    assert rows[1][:2] == ["Memcpy HtoD (Pinned -> Device)", "pointwise"] and len(rows) == 2


def test_mfu_arithmetic_and_the_peak_table():
    assert mfu.local_mfu(flops=3e12, seconds=2.0, world_size=2, peak=1e12) == 0.75
    assert mfu.scaling_efficiency(tokens_per_s=700.0, world_size=4, one_gpu_tokens_per_s=200.0) == 0.875
    assert metrics.PEAK_FLOPS["H200"] == {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12}
    assert metrics.PEAK_FLOPS["B200"]["fp8"] == 2 * metrics.PEAK_FLOPS["B200"]["bf16"] == 4500e12
    assert metrics.datasheet_peak(torch.device("cpu"), "bfloat16") is None
    assert metrics.peak_flops(torch.device("cpu"), "float8", override=5.0) == (5.0, "trainer.peak_flops")
    with pytest.raises(ValueError, match="gemm_dtype 'int4'"):
        metrics.datasheet_peak(torch.device("cpu"), "int4")


def test_a_scheme_declares_its_gemm_dtype():
    assert PrecisionScheme.gemm_dtype == "float32" and testing.HalfGemm.gemm_dtype == "bfloat16"
    assert set(metrics.PEAK_COLUMN) == {"float32", "bfloat16", "float16", "float8"}
    assert not hasattr(metrics, "FP8_SCHEMES")


# ---------------------------------------------------------------------------------- the whole profile


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


@pytest.fixture(scope="module")
def profiled(tmp_path_factory) -> Path:
    """One `gem-train profile` of the tiny inline config, with a third-party plugin's section."""
    out = tmp_path_factory.mktemp("profile")
    mp = pytest.MonkeyPatch()
    mp.setenv("GEM_DISABLE_PLUGIN_AUTOLOAD", "1")
    mp.setenv("GEM_PLUGINS", "gem_model.testing,profile_plugin_cases")
    screen = _Terminal()
    mp.setattr(sys, "stderr", screen)  # a terminal: the profile shows its live display there
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["profile", *TINY, "--out", str(out), "--batches", "3", "--warmup", "1", "--steps", "2"]) == 0
    finally:
        torch.set_num_threads(before)
        mp.undo()
    (out / "terminal.txt").write_text(screen.getvalue())
    return out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_profile_shows_its_progress_by_section_on_a_terminal(profiled: Path):
    screen = (profiled / "terminal.txt").read_text()
    assert "[profile] memory: " in screen  # each section's time, also in CI logs
    assert "profile" in screen and "8/8" in screen and "section/s" in screen


def test_every_section_runs_on_the_tiny_config(profiled: Path):
    report = load_report(profiled)
    names = [s.name for s in report.sections]
    assert names == [*CORE_SECTIONS, "third_party", "mfu", "recommendations"]
    seq = report.section("sequences").summary
    assert seq["batches"] == 3 and seq["samples"] == 48 and 0 < seq["padding_waste_to_max"] < 1
    assert report.section("balance").summary["imbalance"] == {"round_robin": 1.0}  # one rank
    step = report.section("step_time").summary
    assert step["steps"] == 2 and set(step["seconds"]) >= {"attention", "gemm", "pointwise", "idle"}
    assert step["seconds"]["attention"] > 0 and step["seconds"]["gemm"] > 0
    # idle is the wall time no op covers, so the parts add up to the wall time (or more, idle 0)
    assert sum(step["seconds"].values()) >= sum(step["step_seconds"]) * (1 - 1e-9) and step["seconds"]["idle"] >= 0
    memory = report.section("memory").summary
    assert memory["measured_peak"] is None and memory["activations"]["inline_none"]["saved"] > 0
    assert any("not measured on cpu" in n for n in report.section("memory").notes)
    m = report.section("mfu").summary
    assert m["datasheet_peak"] is None and 0 < m["mfu_measured_peak"] < 1 and m["scaling_efficiency"] == 1.0
    recs = report.section("recommendations").summary["actions"]
    gains = [r.expected_gain for s in report.sections for r in s.recommendations]
    assert len(recs) == len(gains) and "nothing at all" in recs


def test_the_plugin_section_saw_the_measured_steps_and_the_core_sections(profiled: Path):
    third = load_report(profiled).section("third_party")
    assert third.summary == {"steps": 2, "core_sections": sorted(CORE_SECTIONS)}


def test_outputs_json_plots_and_html(profiled: Path):
    report = ProfileReport.from_json((profiled / "profile.json").read_text())
    json.loads((profiled / "profile.json").read_text())  # strict JSON
    html = (profiled / "profile.html").read_text()
    assert "<h2>sequences</h2>" in html and report.config_name in html
    pytest.importorskip("matplotlib", reason="the plots need the gem-model[report] extra (matplotlib)")
    for name in ("lengths.png", "step_time.png", "memory.png"):
        assert png_size(profiled / name) == (WIDTH, HEIGHT)
    assert not (profiled / "rank_load.png").exists()  # one rank: nothing to balance, no plot of it
    assert html.count('src="data:image/png;base64,') == 3


def test_the_balance_plot_is_drawn_for_two_ranks_or_more(profiled: Path, tmp_path: Path):
    pytest.importorskip("matplotlib", reason="the plots need the gem-model[report] extra (matplotlib)")
    from gem_model.profiling.plots import write_plots

    report = ProfileReport.from_json((profiled / "profile.json").read_text())
    loads = report.section("balance").series["rank_load"]
    assert all(len(v) == 1 for v in loads.values())
    for name in loads:
        loads[name] = [loads[name][0] / 2] * 2
    assert png_size(write_plots(report, tmp_path)["balance"]) == (WIDTH, HEIGHT)


def test_report_re_renders_from_the_json(profiled: Path, tmp_path: Path, capsys):
    (tmp_path / "profile.json").write_text((profiled / "profile.json").read_text())
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "torch.profiler breakdown" in out and "wrote html" in out
    assert (tmp_path / "profile.html").read_text() == (profiled / "profile.html").read_text()
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "profile.json" in capsys.readouterr().err


def test_a_plugin_adds_a_profile_command(monkeypatch, capsys):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing,profile_plugin_cases")
    assert main(["profile", "hello", "--greeting", "hi"]) == 0
    assert "hi from a plugin's profile command" in capsys.readouterr().out


def test_profile_precision_without_gem_precision_names_it(capsys):
    assert main(["profile", "precision", "--schemes", "bf16"]) == 2
    assert "provided by gem-precision, which is not installed" in capsys.readouterr().err


def test_bad_profile_options_exit_2(monkeypatch, capsys):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    assert main(["profile", *TINY, "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["profile", *TINY, "--world", "2"]) == 2  # the inline single planner drives one process
    assert "--world" in capsys.readouterr().err


def test_a_section_name_twice_is_an_error(pm):
    from gem_model.errors import PluginError
    from gem_model.profiling.context import ProfileContext
    from gem_model.profiling.report import ProfileSection
    from gem_model.profiling.runner import _add

    ctx = ProfileContext(load_config(None, TINY), pm, torch.device("cpu"), 1, 1, 1, Path("."))
    _add(ctx, [ProfileSection("a", "a")])
    with pytest.raises(PluginError, match="two profile sections are named 'a'"):
        _add(ctx, [ProfileSection("a", "again")])


def test_profile_data_still_prints_the_sequences(capsys):
    assert main(["profile", "data", "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "padding waste, to the longest" in out and "% useful" in out


def test_scaling_efficiency_against_a_one_gpu_baseline(profiled: Path, pm):
    from gem_model.profiling.context import MeasuredSteps, ProfileContext
    from gem_model.profiling.runner import _baseline_tokens_per_s

    base = _baseline_tokens_per_s(profiled)
    assert base == load_report(profiled).section("mfu").summary["tokens_per_s"] > 0
    measured = MeasuredSteps([1.0, 1.0], [100, 60], [1e9, 1e9], "inline_comm", world_size=2)
    ctx = ProfileContext(load_config(None, TINY), pm, torch.device("cpu"), 2, 2, 1, Path("."), measured)
    summary = mfu.mfu_section(ctx, baseline_tokens_per_s=40.0).summary
    assert summary["tokens_per_s"] == 80.0 and summary["scaling_efficiency"] == 80.0 / (2 * 40.0)
    assert summary["achieved_flops_per_gpu"] == 2e9 / 2.0 / 2  # per GPU: FLOPs / seconds / processes
