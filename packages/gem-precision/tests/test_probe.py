"""The precision probe: measured errors, recommendations, the YAML it emits, and its CLI.

Only :mod:`gem_model.testing` components plus schemes defined here: ``probe_noise`` adds noise of a
known relative size to a linear's output, so the probe's numbers can be checked exactly.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from fnmatch import fnmatchcase
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gem_model import testing
from gem_model.cli import main
from gem_model.components import ComponentConfig, PrecisionScheme
from gem_model.config import PrecisionConfig, ref
from gem_model.config_io import load_config
from gem_model.data.loader import ShardedLoader
from gem_model.markers import hookimpl
from gem_model.model.gem import GemModel
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components
from gem_model.train.prepare import precision_plan
from gem_precision.precision_map import literal_pattern, recommended_precision
from gem_precision.probe import ProbeOptions, ProbeResult, probe_precision


class _NoisyLinear(nn.Module):
    """The linear's output plus noise of norm exactly ``rel * ||y||`` (fixed per module)."""

    def __init__(self, linear: nn.Linear, rel: float, seed: int):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.rel, self.seed = rel, seed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        noise = torch.randn(y.shape, generator=torch.Generator().manual_seed(self.seed), dtype=torch.float64)
        return (y.double() + noise * (self.rel * y.double().norm() / noise.norm())).to(y.dtype)


class NoiseConfig(ComponentConfig):
    rel: float = 0.03


class NoiseScheme(PrecisionScheme):
    name: ClassVar[str] = "probe_noise"
    Config = NoiseConfig

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        return _NoisyLinear(linear, self.config.rel, zlib.crc32(fqn.encode()))


class PickyScheme(PrecisionScheme):
    """Fine (1 %) everywhere but on the task head (30 %)."""

    name: ClassVar[str] = "probe_picky"

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        return _NoisyLinear(linear, 0.3 if fqn.startswith("task_head.") else 0.01, zlib.crc32(fqn.encode()))


class FussyScheme(PrecisionScheme):
    """Exact, but refuses narrow linears (as a native fp8 GEMM refuses unaligned shapes)."""

    name: ClassVar[str] = "probe_fussy"

    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        if linear.in_features < 16:
            raise ValueError(f"{fqn}: in_features {linear.in_features} < 16")
        return _NoisyLinear(linear, 0.0, 0)


class _ProbePlugin:
    @hookimpl
    def gem_register_precision_schemes(self) -> list[type[PrecisionScheme]]:
        return [NoiseScheme, PickyScheme, FussyScheme]


# the inline components (conftest's INLINE), one HSTU block, small batches: 13 linears
TINY = [
    "kernels.jagged_attention=loop",
    "kernels.norm_gate=loop",
    "parallel.planner=inline_single",
    "comm.strategy=inline_comm",
    "activation.policy=inline_none",
    "precision.scheme=inline_fp32",
    "data.global_batch_size=16",
    "model.num_blocks=1",
    "data.source.options.max_len=15",
    "model.max_seq_len=16",
]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    """These GEMMs are tiny; on a shared 2-core CI machine spinning OpenMP workers made this file
    15x slower (98 s instead of 6)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def probe_pm() -> GemPluginManager:
    return GemPluginManager(autoload=False, plugins=[testing, _ProbePlugin()])


def run_probe(pm: GemPluginManager, *overrides: str, **options: object) -> ProbeResult:
    return probe_precision(load_config(None, [*TINY, *overrides]), pm, ProbeOptions(batches=1, **options))  # type: ignore[arg-type]


def tiny_model(pm: GemPluginManager, config_overrides: list[str]) -> GemModel:
    config = load_config(None, config_overrides)
    c = resolve_components(config, pm)
    spec = ShardedLoader(c.source, c.balancer, global_batch_size=config.data.global_batch_size).spec
    return GemModel(config.model, spec, attention=c.attention, norm_gate=c.norm_gate, next_item_loss=c.next_item_loss)


def test_measures_the_known_relative_error_of_every_linear(probe_pm):
    result = run_probe(probe_pm, schemes=("probe_noise", "inline_bf16", "inline_fp32"))
    model = tiny_model(probe_pm, TINY)
    assert [m.fqn for m in result.modules] == list(precision_plan(model, PrecisionConfig()))
    for m in result.modules:
        linear = model.get_submodule(m.fqn)
        assert (m.in_features, m.out_features) == (linear.in_features, linear.out_features)
        noise, half, exact = m.measures["probe_noise"], m.measures["inline_bf16"], m.measures["inline_fp32"]
        assert noise.rel_err == pytest.approx(0.03, rel=1e-4)
        assert noise.sqnr_db == pytest.approx(-20 * math.log10(0.03), abs=1e-3)
        assert noise.loss_delta != 0.0
        assert 0.0 < half.rel_err < 1e-2 and half.sqnr_db > 40  # bf16 keeps 8 bits: ~2**-9 per element
        assert (exact.rel_err, exact.sqnr_db, exact.loss_delta) == (0.0, math.inf, 0.0)
    assert math.isfinite(result.baseline_loss) and result.baseline_loss > 0


def test_a_configured_scheme_keeps_its_options(probe_pm):
    result = run_probe(
        probe_pm, "precision.scheme=probe_noise", "precision.scheme.options.rel=0.05", schemes=("probe_noise",)
    )
    assert all(m.measures["probe_noise"].rel_err == pytest.approx(0.05, rel=1e-4) for m in result.modules)
    assert result.precision.scheme == ref("probe_noise", rel=0.05)  # still the default: options kept


def test_recommends_the_cheapest_passing_scheme_and_flags_the_rest(probe_pm):
    order = ("probe_picky", "inline_bf16", "inline_fp32")
    result = run_probe(probe_pm, schemes=order, order=order, max_loss_change=1.0)
    rec = result.recommendations()
    assert rec == {f: ("inline_bf16" if f.startswith("task_head.") else "probe_picky") for f in rec}
    assert result.schemes == list(order)
    assert result.precision == PrecisionConfig(
        scheme=ref("probe_picky"), overrides={"task_head.0": "inline_bf16", "task_head.2": "inline_bf16"}
    )
    rows = {line.split()[0]: line for line in result.table().splitlines()[4:] if line and not line.startswith("-")}
    assert "*" in rows["task_head.0"].split("inline_bf16")[0]  # the picky cell is flagged
    assert "*" not in rows["blocks.0.uvqk"] and rows["blocks.0.uvqk"].endswith("probe_picky")


def test_the_loss_threshold_rejects_schemes_that_move_the_loss(probe_pm):
    # every noisy conversion changes the loss a little: with no room at all only exact ones pass
    result = run_probe(
        probe_pm, schemes=("probe_noise", "inline_fp32"), order=("probe_noise", "inline_fp32"),
        max_rel_err=1.0, max_loss_change=0.0,
    )  # fmt: skip
    assert set(result.recommendations().values()) == {"inline_fp32"}
    assert result.precision == PrecisionConfig(scheme=ref("inline_fp32"))


def test_a_scheme_that_cannot_convert_a_module_is_reported_not_recommended(probe_pm):
    result = run_probe(probe_pm, schemes=("probe_fussy",))
    narrow = next(m for m in result.modules if m.in_features < 16)
    assert narrow.fqn == "dense_proj" and "in_features 8 < 16" in (narrow.measures["probe_fussy"].error or "")
    assert narrow.recommended is None  # no candidate passed: left in fp32 through `exclude`
    assert result.precision.exclude == ["dense_proj"] and result.precision.scheme.name == "probe_fussy"
    assert "error" in next(line for line in result.table().splitlines() if line.startswith("dense_proj"))
    assert all(m.recommended == "probe_fussy" for m in result.modules if m is not narrow)


def test_the_yaml_is_a_config_that_reproduces_the_map(probe_pm, tmp_path: Path):
    order = ("probe_picky", "probe_fussy", "inline_bf16")
    result = run_probe(probe_pm, schemes=order, order=order, max_loss_change=1.0)
    path = tmp_path / "precision.yaml"
    path.write_text(result.yaml())
    loaded = load_config(path)
    assert loaded.precision == result.precision
    model = tiny_model(probe_pm, TINY)
    assert precision_plan(model, loaded.precision) == result.recommendations()
    rec = result.recommendations()
    assert rec["dense_proj"] == "probe_picky" and rec["task_head.0"] == "probe_fussy"
    # and the run config accepts it as it is: every name resolves
    run = load_config(path, [o for o in TINY if not o.startswith("precision.")])
    assert set(resolve_components(run, probe_pm).precision) == {"probe_picky", "probe_fussy"}
    data = result.to_json()
    json.dumps(data, allow_nan=False)  # exact outputs (SQNR inf) are null, not Infinity
    assert data["precision"]["overrides"] == {"task_head.0": "probe_fussy", "task_head.2": "probe_fussy"}


def test_a_ranker_orders_each_linears_candidates_and_leaves_some_out(probe_pm):
    seen = {}

    def rank(linears, schemes):
        assert list(schemes) == ["inline_bf16", "probe_picky", "inline_fp32"]  # options.order
        seen.update({lin.fqn: lin for lin in linears})
        return {lin.fqn: ["inline_fp32"] if lin.fqn.startswith("task_head.") else ["probe_picky", "inline_bf16"]
                for lin in linears}  # fmt: skip

    order = ("inline_bf16", "probe_picky", "inline_fp32")
    options = ProbeOptions(batches=1, schemes=order, order=order, max_loss_change=1.0, loss_until_pass=True)
    result = probe_precision(load_config(None, TINY), probe_pm, options, rank=rank)
    assert set(seen) == set(result.recommendations()) and all(lin.current == "inline_fp32" for lin in seen.values())
    assert seen["dense_proj"].rows == 16 and seen["dense_proj"].in_features == 8  # one row per sample of the batch
    assert seen["blocks.0.uvqk"].rows > 16  # one per token of the histories
    for m in result.modules:
        head = m.fqn.startswith("task_head.")
        # inline_bf16 passes everywhere and comes first in options.order, but the ranker decides
        assert m.recommended == ("inline_fp32" if head else "probe_picky") and m.rows == seen[m.fqn].rows
        assert m.order == (["inline_fp32"] if head else ["probe_picky", "inline_bf16"])
        assert math.isnan(m.measures["inline_bf16"].loss_delta)  # never reached: not measured
        assert math.isnan(m.measures["probe_picky"].loss_delta) is head


def test_recommended_precision_ties_and_patterns():
    order = ["cheap", "dear"]
    got = recommended_precision({"a": "dear", "b": "cheap", "c[0]": None}, order, PrecisionConfig())
    assert got.scheme.name == "cheap" and got.overrides == {"a": "dear"} and got.exclude == ["c[[]0]"]
    assert fnmatchcase("c[0]", literal_pattern("c[0]")) and not fnmatchcase("c0", literal_pattern("c[0]"))
    assert fnmatchcase("x*y?", literal_pattern("x*y?")) and not fnmatchcase("xzyz", literal_pattern("x*y?"))
    nothing = recommended_precision({"a": None}, order, PrecisionConfig(scheme=ref("dear", fast=True)))
    assert nothing.scheme == ref("dear", fast=True) and nothing.exclude == ["a"]
    wide = recommended_precision({"a": "cheap"}, order, PrecisionConfig(activation_dtype="float32"))
    assert wide.activation_dtype == "float32"  # the map changes the schemes, not the dtype the run chose


def test_bad_options_are_config_errors(probe_pm):
    from gem_model.errors import ConfigError, UnknownNameError

    with pytest.raises(ConfigError, match="--batches"):
        probe_precision(load_config(None, TINY), probe_pm, ProbeOptions(batches=0))
    with pytest.raises(ConfigError, match="--max-rel-err"):
        run_probe(probe_pm, max_rel_err=float("nan"))
    with pytest.raises(UnknownNameError, match="nope"):
        run_probe(probe_pm, schemes=("nope",))


# ---------------------------------------------------------------------------------------------- CLI


@pytest.fixture
def inline_env(monkeypatch):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing,gem_precision.plugin")


def test_cli_prints_the_table_and_writes_yaml_and_json(capsys, inline_env, tmp_path: Path):
    out_yaml, out_json = tmp_path / "p.yaml", tmp_path / "p.json"
    argv = ["profile", "precision", *TINY, "--batches", "1", "--schemes", "inline_bf16,inline_fp32", "--by", "bits",
            "--order", "inline_bf16,inline_fp32", "--out-yaml", str(out_yaml), "--out-json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "blocks.0.uvqk" in out and "recommended" in out and "precision:\n  scheme: inline_bf16" in out
    assert load_config(out_yaml).precision == PrecisionConfig(scheme=ref("inline_bf16"))
    data = json.loads(out_json.read_text())
    assert data["schemes"] == ["inline_bf16", "inline_fp32"] and len(data["modules"]) == 13


def test_cli_by_speed_prints_the_rates_and_a_block_of_what_pays_here(capsys, inline_env, tmp_path: Path):
    out_yaml, out_json = tmp_path / "p.yaml", tmp_path / "p.json"
    argv = ["profile", "precision", *TINY, "--batches", "1", "--schemes", "inline_bf16,inline_fp32",
            "--out-yaml", str(out_yaml), "--out-json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "measured on cpu: each linear's forward and backward" in out and "why this backend" in out
    data = json.loads(out_json.read_text())
    assert set(data["rates"]["schemes"]) == {"as is", "inline_bf16", "inline_fp32"} and len(data["modules"]) == 13
    assert data["current"] == dict.fromkeys(data["recommended"], "inline_fp32")
    if data["recommended"] == data["current"]:  # nothing measured faster here: nothing to change
        assert out_yaml.read_text().startswith("# gem-train profile precision: nothing to change")
    else:  # the block is the map, and the memory it needs was checked against this host's
        model = tiny_model(GemPluginManager(autoload=False), TINY)  # GEM_PLUGINS names the inline plugins
        assert precision_plan(model, load_config(out_yaml).precision) == data["recommended"]
        assert data["memory"]["fits"] and "available memory" in data["memory"]["words"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schemes", "nope"], "unknown precision scheme 'nope'"),
        (["--order", "inline_bf16,inline_fp33"], "unknown precision scheme 'inline_fp33'"),
        (["--batches", "0"], "--batches: must be at least 1"),
        (["model.num_blocks=0"], "model.num_blocks"),
    ],
)
def test_cli_config_errors_exit_2(capsys, inline_env, args: list[str], message: str):
    assert main(["profile", "precision", *TINY, *args]) == 2
    assert message in capsys.readouterr().err
