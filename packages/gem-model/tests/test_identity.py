"""Run identity by meaning: configs that resolve to the same run are one run (each component's
options compared after its ``Config`` filled them), and configs that differ in what changes the
math (kernels, train pipeline, precision, compile, an option a component declares) are two."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import ClassVar

import pytest

from gem_model import testing
from gem_model.components import CommStrategy, ComponentConfig
from gem_model.config_io import load_config
from gem_model.errors import CheckpointError
from gem_model.lifecycle import TrainPipeline
from gem_model.markers import hookimpl
from gem_model.plugins import GemPluginManager
from gem_model.train.identity import differences
from gem_model.train.outputs import output_dir as output_dir_of
from gem_model.trainer import train
from gem_model.tune.search import Candidate, TuneResult, write_result

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


class QuietComm(testing.PlainComm):
    """Moves the same values another way: not another run (a communication strategy's default)."""

    name: ClassVar[str] = "quiet_comm"


class LossyConfig(ComponentConfig):
    bits: int = 8
    label: str = "lossy"


class LossyComm(testing.PlainComm):
    """Rounds what it reduces: declares ``bits`` (and its name) as shaping the run, not ``label``."""

    name: ClassVar[str] = "lossy_comm"
    Config = LossyConfig
    shapes_run: ClassVar[bool | frozenset[str]] = frozenset({"bits"})


class OtherPipeline(TrainPipeline):
    name: ClassVar[str] = "other_pipeline"

    def forward_and_loss(self, batch):
        raise NotImplementedError

    def backward(self, loss):
        raise NotImplementedError

    def optimizer_step(self):
        raise NotImplementedError


class Extras:
    @hookimpl
    def gem_register_comm_strategies(self):
        return [QuietComm, LossyComm]

    @hookimpl
    def gem_register_train_pipelines(self):
        return [OtherPipeline]


assert issubclass(QuietComm, CommStrategy) and QuietComm.shapes_run is False


@pytest.fixture
def extras_pm() -> GemPluginManager:
    return GemPluginManager(autoload=False, plugins=[testing, Extras()])


def dump(*overrides: str) -> dict:
    return load_config(None, [*testing.INLINE_COMPONENTS, *overrides]).model_dump(mode="json")


def test_the_default_run_spelled_out_is_the_default_run(pm):
    spelled_out = load_config(CONFIGS / "tiny.yaml", []).model_dump(mode="json")
    assert differences(load_config(None, []).model_dump(mode="json"), spelled_out, pm) == []


def test_a_checkpoint_from_before_the_loss_kernel_field_is_the_same_run_on_the_torch_loss(pm):
    """Configs written before ``kernels.next_item_loss`` existed ran the core's torch loss: read so."""
    current = load_config(None, []).model_dump(mode="json")
    older = copy.deepcopy(current)
    del older["kernels"]["next_item_loss"]
    assert differences(older, current, pm) == []
    other = copy.deepcopy(current)
    other["kernels"]["next_item_loss"] = {"name": "triton", "options": {}}
    assert differences(older, other, pm) == ['kernels.next_item_loss.name ("torch" -> "triton")']


def test_the_lookup_bags_do_not_make_another_run(pm):
    """``model.lookup_bags_per_sample`` only batches the lookup (the same rows come back): a checkpoint
    written before it existed, or with another count, continues the run; a model field that changes the
    values still makes another run."""
    current = load_config(None, []).model_dump(mode="json")
    older = copy.deepcopy(current)
    del older["model"]["lookup_bags_per_sample"]
    assert differences(older, current, pm) == []
    whole = copy.deepcopy(current)
    whole["model"]["lookup_bags_per_sample"] = None
    assert differences(whole, current, pm) == []
    wider = copy.deepcopy(current)
    wider["model"]["embedding_dim"] = current["model"]["embedding_dim"] * 2
    changed = differences(current, wider, pm)
    assert changed and all(d.startswith("model.embedding_dim") for d in changed)


def test_options_left_to_their_defaults_continue_the_run(pm, tiny_overrides, tmp_path, capsys):
    train(load_config(None, [*tiny_overrides, "trainer.steps=2"]), pm)
    capsys.readouterr()
    written_out = ["data.source.options.length_exponent=0.8", "data.source.options.zipf_exponent=1.05"]
    train(load_config(None, [*tiny_overrides, *written_out, "trainer.steps=3"]), pm)
    assert "continuing from" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ("kernels.jagged_attention=poison", 'kernels.jagged_attention.name ("loop" -> "poison")'),
        ("trainer.pipeline=other_pipeline", 'trainer.pipeline.name ("sequential" -> "other_pipeline")'),
        ("precision.scheme=inline_bf16", 'precision.scheme.name ("inline_fp32" -> "inline_bf16")'),
        ("trainer.compile=true", "trainer.compile (false -> true)"),
        ("comm.strategy=lossy_comm", 'comm.strategy.name (unset -> "lossy_comm")'),
    ],
)
def test_what_changes_the_math_makes_another_run_naming_the_field(extras_pm, change, field):
    assert field in differences(dump(), dump(change), extras_pm)


def test_what_only_observes_or_moves_the_values_does_not(extras_pm):
    assert differences(dump(), dump("comm.strategy=quiet_comm", "callbacks=[inline_recorder]"), extras_pm) == []
    lossy = dump("comm.strategy=lossy_comm")
    assert differences(lossy, dump("comm.strategy=lossy_comm", "comm.strategy.options.label=other"), extras_pm) == []
    assert differences(lossy, dump("comm.strategy=lossy_comm", "comm.strategy.options.bits=4"), extras_pm) == [
        "comm.strategy.options.bits (8 -> 4)"
    ]


def test_a_checkpoint_of_another_kernel_is_another_runs(pm, tiny_overrides):
    train(load_config(None, [*tiny_overrides, "trainer.steps=1"]), pm)
    with pytest.raises(CheckpointError, match="another run") as info:
        train(load_config(None, [*tiny_overrides, "trainer.steps=2", "kernels.jagged_attention=poison"]), pm)
    assert 'kernels.jagged_attention.name ("loop" -> "poison")' in str(info.value)


@pytest.mark.parametrize("output_dir", ["runs/{name}", "/data/my-run"])
def test_tuned_yaml_is_a_run_of_its_own(pm, tmp_path, output_dir):
    config = load_config(None, [*testing.INLINE_COMPONENTS, f"trainer.output_dir={output_dir}"])
    best = load_config(None, [*testing.INLINE_COMPONENTS, f"trainer.output_dir={output_dir}", "precision.scheme=inline_bf16"])
    baseline = Candidate("baseline", {})
    write_result(TuneResult(baseline, [], best, {"precision.scheme": "inline_bf16"}), tmp_path)
    tuned = load_config(tmp_path / "tuned.yaml", [])
    assert tuned.name == "gem-tiny-tuned" and tuned.precision.scheme.name == "inline_bf16"
    assert output_dir_of(tuned) != output_dir_of(config)  # gem-train run -c tuned.yaml meets no other run
    assert differences(best.model_dump(mode="json"), tuned.model_dump(mode="json"), pm) == [
        'name ("gem-tiny" -> "gem-tiny-tuned")'
    ]
