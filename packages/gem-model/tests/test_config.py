"""Config files, overrides and the errors a malformed config gives."""

from __future__ import annotations

import pytest

from gem_model.config import RunConfig
from gem_model.config_io import apply_overrides, load_config
from gem_model.errors import ConfigError, UnknownNameError
from gem_model.model.next_item import TorchNextItemLoss
from gem_model.resolve import component_paths, resolve_components


def test_defaults_are_the_tiny_cpu_run():
    c = load_config()
    assert c == RunConfig()
    assert c.parallel.planner.name == "single" and c.trainer.device == "auto"


def test_yaml_and_toml_files_give_the_same_config(tmp_path):
    (tmp_path / "a.yaml").write_text("model:\n  num_blocks: 3\nprecision:\n  scheme: bf16\n")
    (tmp_path / "a.toml").write_text('[model]\nnum_blocks = 3\n[precision]\nscheme = "bf16"\n')
    assert load_config(tmp_path / "a.yaml") == load_config(tmp_path / "a.toml")
    assert load_config(tmp_path / "a.yaml").precision.scheme.name == "bf16"


def test_overrides_parse_values_and_reach_component_options():
    c = load_config(None, ["trainer.steps=7", "model.dropout=0.1", "data.source.options.num_items=99", "trainer.resume=true"])
    assert c.trainer.steps == 7 and c.model.dropout == 0.1 and c.trainer.resume is True
    assert c.data.source.name == "synthetic" and c.data.source.options == {"num_items": 99}


def test_override_does_not_mutate_its_input():
    data = {"model": {"num_blocks": 1}}
    apply_overrides(data, ["model.num_blocks=4"])
    assert data == {"model": {"num_blocks": 1}}


@pytest.mark.parametrize(
    ("override", "path", "value"),
    [
        ("model.num_blocks=0", "model.num_blocks", "0"),
        ("model.embeding_dim=8", "model.embeding_dim", "8"),
        ("trainer.device=gpu", "trainer.device", "'gpu'"),
        ("data.global_batch_size=many", "data.global_batch_size", "'many'"),
    ],
)
def test_bad_values_name_the_dotted_path_and_value(override, path, value):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert f"{path}:" in str(err.value) and f"(got {value})" in str(err.value)


def test_unreadable_and_missing_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(ConfigError, match="must end in"):
        load_config(tmp_path / "c.json")


def test_malformed_override_syntax():
    with pytest.raises(ConfigError, match="key.sub=value"):
        load_config(None, ["trainer.steps"])


def test_component_options_are_checked_by_the_component_config(pm, tiny_overrides):
    c = load_config(None, [*tiny_overrides, "data.source.options.num_itemz=5"])
    with pytest.raises(ConfigError, match=r"data\.source\.options\.num_itemz: Extra inputs"):
        resolve_components(c, pm)
    c = load_config(None, [*tiny_overrides, "data.source.options.num_items=1"])
    with pytest.raises(ConfigError, match=r"data\.source\.options\.num_items: Input should be greater"):
        resolve_components(c, pm)


def test_every_unknown_name_is_reported_at_once(pm, tiny_overrides):
    c = load_config(None, [*tiny_overrides, "precision.scheme=fp4", "comm.strategy=carrier_pigeon"])
    with pytest.raises(UnknownNameError) as err:
        resolve_components(c, pm)
    assert "precision.scheme: unknown precision scheme 'fp4'" in str(err.value)
    assert "comm.strategy: unknown comm strategy 'carrier_pigeon'" in str(err.value)


def test_the_next_item_loss_kernel_defaults_to_the_cores_torch(pm, tiny_overrides):
    config = load_config(None, tiny_overrides)
    assert config.kernels.next_item_loss.name == "torch"
    comps = resolve_components(config, pm)
    assert type(comps.next_item_loss) is TorchNextItemLoss
    assert ("kernels.next_item_loss", "torch", comps.next_item_loss) in comps.named()
    assert (["kernels", "next_item_loss"], comps.next_item_loss) in component_paths(config, comps)


def test_an_unknown_next_item_loss_kernel_is_named_with_its_package(pm, tiny_overrides):
    """'triton' is gem-kernels', not registered here: the error names the slot, what is there and what to install."""
    config = load_config(None, [*tiny_overrides, "kernels.next_item_loss=triton"])
    with pytest.raises(UnknownNameError) as err:
        resolve_components(config, pm)
    msg = str(err.value)
    assert "kernels.next_item_loss: unknown kernel next_item_loss 'triton'" in msg
    assert "provided by gem-kernels, which is not installed" in msg and "torch: from gem-model" in msg


def test_override_patterns_resolve_their_schemes(pm, tiny_overrides):
    c = load_config(None, [*tiny_overrides, "precision.overrides={'cross.*': inline_bf16}"])
    comps = resolve_components(c, pm)
    assert set(comps.precision) == {"inline_fp32", "inline_bf16"}
    bad = load_config(None, [*tiny_overrides, "precision.overrides={'cross.*': nope}"])
    with pytest.raises(UnknownNameError, match=r"precision\.overrides\.cross\.\*"):
        resolve_components(bad, pm)
