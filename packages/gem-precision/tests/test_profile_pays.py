"""The numerics section recommends a scheme for a linear only where it pays on the profile's device:
measured faster there than the config's scheme, never through an emulated backend, within the
numerics, and only where the whole map fits the device's memory.

The rates and the memory are handed in through the section's seams (``numerics_section(ctx,
measure=...)`` and ``ProfileContext.fit_memory``), so these tests decide what the device measures.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml

from gem_model import testing
from gem_model.api import MemoryFit, PrecisionConfig, precision_plan
from gem_model.config import ref
from gem_model.config_io import load_config
from gem_model.plugins import GemPluginManager
from gem_model.profiling.context import MeasuredSteps, ProfileContext
from gem_model.profiling.shared_model import initial_model
from gem_precision import plugin
from gem_precision.gemm_rates import AS_IS, Backend, LinearShape, Measure, RateTable, Timing, backend_of
from gem_precision.pays import MIN_SPEEDUP, SpeedRanker, Why, decide
from gem_precision.probe import ModuleReport, ProbedLinear, ProbeOptions, ProbeResult, SchemeMeasure
from gem_precision.profile import numerics_section
from gem_precision.schemes import MXFP8Scheme, ScaledScheme

BF16_RUN = [*testing.INLINE_OVERRIDES, "precision.scheme=bf16"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def pm() -> GemPluginManager:
    return GemPluginManager(autoload=False, plugins=[testing, plugin])


@pytest.fixture
def ctx(pm) -> ProfileContext:
    config, cpu = load_config(None, BF16_RUN), torch.device("cpu")
    return ProfileContext(config, pm, cpu, 1, 1, 1, Path("."), build_model=lambda: initial_model(config, pm, cpu))


def rates(tflops: dict[str, float], backends: dict[str, str] | None = None) -> Measure:
    """A device on which every linear of a scheme runs at ``tflops[scheme]`` (1 if not named; its
    GEMMs alone twice as fast), on the backend ``backends`` names (``native`` if not named)."""
    backends = backends or {}

    def measure(schemes, shapes: list[LinearShape], device, dtype) -> RateTable:
        table = RateTable("test-gpu", {AS_IS: Backend("torch", False, "float32")}, shapes={s.key: s for s in shapes})
        for name in schemes:
            b = backends.get(name, "native")
            table.backends[name] = Backend(b, b == "emulated", f"{b} in this test")
        for name in [AS_IS, *schemes]:
            rate = tflops.get(name, 1.0) * 1e12
            table.timings[name] = {s.key: Timing(s.flops(s.timed_rows) / rate, s.flops(s.timed_rows) / rate / 2,
                                                 s.timed_rows) for s in shapes}  # fmt: skip
        return table

    return measure


def section(ctx: ProfileContext, measure: Measure):
    return numerics_section(ctx, measure=measure)


def kinds(numerics, scheme: str) -> set[str]:
    return {mine[scheme]["kind"] for mine in numerics.summary["why_not"].values()}


def test_an_emulated_backend_is_never_recommended_for_speed_however_fast_it_is_timed(ctx):
    numerics = section(ctx, rates({"mxfp8": 1000.0, "bf16": 10.0}, {"mxfp8": "emulated"}))
    assert set(numerics.summary["recommended"].values()) == {"bf16"}  # the config's scheme stays everywhere
    assert kinds(numerics, "mxfp8") == {"emulated"}
    assert "precision_yaml" not in numerics.summary and numerics.recommendations == []
    row = next(r for r in numerics.tables[1].rows if r[0] == "mxfp8")
    assert row[1] == "emulated" and row[-1] == "not recommended: emulated here x13"


def test_a_non_emulated_backend_measured_faster_is_recommended_where_the_numerics_pass(ctx):
    numerics = section(ctx, rates({"mxfp8": 1000.0, "bf16": 10.0}, {"mxfp8": "triton"}))
    recommended = numerics.summary["recommended"]
    assert "mxfp8" in recommended.values()
    for fqn, scheme in recommended.items():  # where mxfp8 is not taken, its numerics are why
        assert scheme == "mxfp8" or numerics.summary["why_not"][fqn]["mxfp8"]["kind"] == "numerics"
    assert "mxfp8" in numerics.summary["precision_yaml"]


def test_a_scheme_measured_slower_here_is_not_recommended(ctx):
    numerics = section(ctx, rates({"fp8_rowwise": 8.0, "fp8_tensorwise": 20.0, "bf16": 10.0}))
    recommended = numerics.summary["recommended"]
    assert "fp8_rowwise" not in recommended.values() and kinds(numerics, "fp8_rowwise") == {"slower"}
    assert set(recommended.values()) <= {"fp8_tensorwise", "bf16"} and "fp8_tensorwise" in recommended.values()
    why = numerics.summary["why_not"]["blocks.0.uvqk"]["fp8_rowwise"]["text"]
    assert why == "slower here (0.80x the current speed)"


def test_a_map_that_does_not_fit_the_device_is_not_made_and_the_report_says_why(ctx):
    asked = []

    def too_big(precision):
        asked.append(precision)
        return MemoryFit(200e9, 141e9, "the test GPU's 141 GB", "static 25 GB + activations 175 GB")

    ctx.fit_memory = too_big
    numerics = section(ctx, rates({"fp8_tensorwise": 20.0, "bf16": 10.0}))
    assert [p.scheme.name for p in asked] == ["fp8_tensorwise"]  # the map it would have recommended
    assert set(numerics.summary["recommended"].values()) == {"bf16"}
    assert "precision_yaml" not in numerics.summary and numerics.recommendations == []
    words = "needs 200 GB per rank (static 25 GB + activations 175 GB), more than the test GPU's 141 GB"
    assert numerics.summary["memory"] == {"need_bytes": 200e9, "budget_bytes": 141e9, "fits": False, "words": words}
    assert kinds(numerics, "fp8_tensorwise") <= {"memory", "numerics"} and "memory" in kinds(numerics, "fp8_tensorwise")
    assert any(n.endswith(words) and n.startswith("the map with fp8_tensorwise for") for n in numerics.notes)
    row = next(r for r in numerics.tables[1].rows if r[0] == "fp8_tensorwise")
    assert "does not fit" in row[-1]


def test_the_expected_gain_by_hand_and_a_map_that_fits(ctx):
    ctx.fit_memory = lambda precision: MemoryFit(30e9, 141e9, "the test GPU's 141 GB", "b")
    ctx.measured = MeasuredSteps([2.0], [100], [1.0], "inline_comm", unprofiled_step_seconds=[0.5, 0.5])
    numerics = section(ctx, rates({"fp8_tensorwise": 20.0, "bf16": 10.0}))
    summary = numerics.summary
    flops = {f: 6.0 * rows * int(shape.split("x")[0]) * int(shape.split("x")[1])
             for f, rows, shape in ((r[0], summary["rows_per_step"][r[0]], r[1]) for r in numerics.tables[0].rows)}  # fmt: skip
    faster = [f for f, s in summary["recommended"].items() if s == "fp8_tensorwise"]
    saving = sum(flops[f] / 10e12 - flops[f] / 20e12 for f in faster)  # bf16 at 10 TFLOP/s, fp8 at 20
    assert summary["linears_s_per_step"]["now"] == pytest.approx(sum(flops.values()) / 10e12)
    assert summary["expected_step_gain"] == pytest.approx(saving / 0.5)  # the unprofiled step: 0.5 s
    (rec,) = numerics.recommendations
    assert rec.metric == "step time" and rec.expected_gain == pytest.approx(saving / 0.5)
    assert "within the test GPU's 141 GB" in rec.evidence
    block = PrecisionConfig.model_validate(yaml.safe_load(summary["precision_yaml"])["precision"])
    assert precision_plan(ctx.model(), block) == summary["recommended"]  # the block a run loads is the map


def test_backends_a_gpu_resolves(pm, monkeypatch):
    """What each backend means for speed: an emulated one never pays, the Triton MX GEMM and a native
    one may (the measurement decides), one the device lacks cannot run."""
    scheme = MXFP8Scheme(MXFP8Scheme.Config())
    for backend, emulated in (("native", False), ("triton", False), ("emulated", True)):
        monkeypatch.setattr(ScaledScheme, "resolved_backend", lambda self, device, b=backend: b)
        monkeypatch.setattr(ScaledScheme, "backend_reason", lambda self, device: "why")
        got = backend_of(scheme, torch.device("cuda"))
        assert (got.name, got.emulated, got.error) == (backend, emulated, None)

    def lacks(self, device):
        raise RuntimeError("precision scheme 'mxfp8': backend 'native' needs CUDA capability >= 10.0")

    monkeypatch.setattr(ScaledScheme, "resolved_backend", lacks)
    assert "needs CUDA capability >= 10.0" in (backend_of(scheme, torch.device("cuda")).error or "")
    bf16 = pm.precision_schemes.get("bf16").cls()
    assert backend_of(bf16, torch.device("cuda")) == Backend(
        "torch", False, "a torch matmul in bfloat16 (cast, no scales)"
    )


def test_mxfp8_on_a_hopper_says_it_runs_the_triton_gemm_and_why(monkeypatch):
    import gem_precision.schemes as schemes

    hopper = (9, 0)
    monkeypatch.setattr(schemes, "has_capability", lambda device, minimum: hopper >= minimum)
    monkeypatch.setattr(schemes, "describe", lambda device: "cuda:0 (compute capability 9.0)")
    mx = MXFP8Scheme(MXFP8Scheme.Config())
    assert mx.resolved_backend("cuda:0") == "triton"
    assert mx.backend_reason("cuda:0") == (
        "no cuBLAS block-scaled MXFP8 on cuda:0 (compute capability 9.0) (needs CUDA compute capability >= 10.0): "
        "the Triton MX GEMM on fp8 tensor cores")  # fmt: skip
    emulated = MXFP8Scheme(MXFP8Scheme.Config(backend="emulated"))
    assert emulated.backend_reason("cuda:0") == "backend 'emulated' as configured"


def test_the_ranker_compares_with_the_configs_scheme_even_when_it_is_no_candidate(pm):
    asked = []

    def measure(schemes, shapes, device, dtype):
        asked.append(list(schemes))
        return rates({"fp8_tensorwise": 10.0 * MIN_SPEEDUP, "fp8_rowwise": 10.0 * (MIN_SPEEDUP - 0.01), "bf16": 10.0})(
            schemes, shapes, device, dtype
        )

    schemes = {n: pm.precision_schemes.get(n).cls() for n in ("bf16", "fp8_rowwise", "fp8_tensorwise")}
    ranker = SpeedRanker(torch.device("cpu"), torch.bfloat16, 4.0, measure, configured={"bf16": schemes.pop("bf16")})
    order = ranker([ProbedLinear("blocks.0.uvqk", 64, 256, 25, "bf16")], schemes)
    assert asked == [["bf16", "fp8_rowwise", "fp8_tensorwise"]]  # the config's scheme is timed too
    assert ranker.shapes["blocks.0.uvqk"] == LinearShape(64, 256, 100)  # the run's rows: 4 per probed row
    # only a scheme at least MIN_SPEEDUP faster ranks ahead of the config's; a slower one follows it
    assert order == {"blocks.0.uvqk": ["fp8_tensorwise", "bf16", "fp8_rowwise"]}
    assert ranker.why["blocks.0.uvqk"]["fp8_rowwise"].kind == "slower"


def test_when_the_speed_changes_do_not_fit_the_numerics_changes_are_checked_without_them(pm):
    """Linear ``a`` would take fp8 for speed; on ``b`` the config's bf16 fails the numerics and fp32
    passes. The map with fp8 does not fit, the one with only ``b``'s fp32 does."""
    schemes = {n: pm.precision_schemes.get(n).cls() for n in ("fp8_tensorwise", "bf16", "fp32")}
    ranker = SpeedRanker(torch.device("cpu"), torch.bfloat16, 1.0, rates({"fp8_tensorwise": 20.0, "bf16": 10.0}))
    orders = ranker([ProbedLinear("a", 64, 64, 100, "bf16"), ProbedLinear("b", 64, 64, 100, "bf16")], schemes)
    assert orders == {"a": ["fp8_tensorwise", "bf16", "fp32"], "b": ["fp8_tensorwise", "bf16", "fp32"]}
    ok, bad = SchemeMeasure(0.01, 40.0, 0.0), SchemeMeasure(0.2, 14.0, 0.0)
    modules = [ModuleReport("a", 64, 64, {"fp8_tensorwise": ok, "bf16": ok, "fp32": ok}, "fp8_tensorwise",
                            100, "bf16", orders["a"]),
               ModuleReport("b", 64, 64, {"fp8_tensorwise": bad, "bf16": bad, "fp32": ok}, "fp32",
                            100, "bf16", orders["b"])]  # fmt: skip
    result = ProbeResult("t", 1, 1.0, list(schemes), ProbeOptions(), modules)
    checked = []

    def fit(block: PrecisionConfig) -> MemoryFit:
        checked.append(block)
        uses_fp8 = "fp8_tensorwise" in {block.scheme.name, *block.overrides.values()}
        return MemoryFit(200e9 if uses_fp8 else 100e9, 141e9, "141 GB", "-")

    decision = decide(result, ranker, PrecisionConfig(scheme=ref("bf16")), fit)
    assert len(checked) == 2 and decision.recommended == {"a": "bf16", "b": "fp32"}
    assert decision.precision == PrecisionConfig(scheme=ref("bf16"), overrides={"b": "fp32"}, min_dim=0)
    assert decision.why["a"]["fp8_tensorwise"].kind == "memory" and decision.why["b"]["fp32"].kind == "recommended"
    assert decision.why["b"]["bf16"] == decision.why["b"]["fp8_tensorwise"] == Why("numerics", "numerics: rel err 0.2 > 0.1")
    assert decision.not_made == ["the map with fp8_tensorwise for 1 linear(s), fp32 for 1 linear(s): needs 200 GB "
                                 "per rank (-), more than 141 GB"]  # fmt: skip
    assert decision.seconds_after > decision.seconds_now  # fp32 for numerics costs time: it is said, not hidden
