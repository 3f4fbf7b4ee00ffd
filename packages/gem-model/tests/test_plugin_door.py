"""The plugin author's door: a plugin and its tests need gem_model.api and gem_model.testing only,
and docs/plugins.md documents what they use (StepResult's fields, TrainPipeline's attributes)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

import gem_model.api as api
from gem_model import testing
from gem_model.lifecycle import TrainPipeline

DOC = (Path(__file__).resolve().parents[3] / "docs" / "plugins.md").read_text()


class CopyAttention(api.JaggedAttentionKernel):
    """A third-party kernel written from docs/plugins.md: the loop reference, refusing the meta device."""

    name = "copy_attention"

    def check_available(self, device):
        if device.type == "meta":
            raise api.KernelUnavailableError("copy_attention computes on real devices only")

    def __call__(self, q, k, v, seq_offsets, **kwargs):
        return testing.LoopAttention()(q, k, v, seq_offsets, **kwargs)


class Plugin:
    @api.hookimpl
    def gem_register_kernels(self):
        return [CopyAttention]


def test_a_kernel_plugin_and_its_test_need_only_the_public_modules():
    pm = api.GemPluginManager(autoload=False, plugins=[Plugin()])
    entry = pm.kernel_registry("jagged_attention").get("copy_attention")
    assert isinstance(entry, api.Entry) and isinstance(entry.provider, api.Provider) and entry.cls is CopyAttention
    with pytest.raises(api.UnknownNameError, match="unknown kernel jagged_attention 'nope'"):
        pm.kernel_registry("jagged_attention").get("nope")
    with pytest.raises(api.KernelUnavailableError):
        CopyAttention().check_available(torch.device("meta"))
    lengths = torch.tensor([3, 0, 5])
    q, k, v = (torch.randn(8, 2, 4) for _ in range(3))
    out = CopyAttention()(q, k, v, api.offsets_of(lengths), max_seq_len=8, alpha=0.5)
    ref = testing.LoopAttention()(q, k, v, api.offsets_of(lengths), max_seq_len=8, alpha=0.5)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert issubclass(api.ConfigError, api.GemError) and issubclass(api.PluginError, api.GemError)
    # this module's own imports: the public ones only (and torch, pytest)
    tree = ast.parse(Path(__file__).read_text())
    core = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("gem_model")}
    core |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if a.name.startswith("gem_model")}
    assert core <= {"gem_model", "gem_model.api", "gem_model.lifecycle"}  # lifecycle: only to check the docs below


@pytest.mark.parametrize("field", [f.name for f in dataclasses.fields(api.StepResult)])
def test_every_step_result_field_is_documented(field):
    assert f"`StepResult.{field}`" in DOC


def test_step_results_count_from_zero_and_the_docs_say_so():
    assert "**0-based**" in DOC and '`"step": 1`' in DOC


def test_the_pipeline_base_attributes_are_documented():
    class Probe(TrainPipeline):
        name = "probe"

        def forward_and_loss(self, batch):
            return None

        def backward(self, loss):
            pass

        def optimizer_step(self):
            pass

    pipeline = Probe()
    pipeline.setup(model=object(), optimizers=object(), feed=object(), layout=object())  # type: ignore[arg-type]
    set_by_setup = sorted(vars(pipeline).keys() - {"config"})
    assert set_by_setup == ["feed", "layout", "model", "optimizers"]
    assert all(f"`self.{name}`" in DOC for name in set_by_setup)


@pytest.mark.parametrize(
    "name",
    ["GemPluginManager", "Registry", "Entry", "Provider", "ConfigError", "KernelUnavailableError", "PluginError",
     "UnknownNameError", "DuplicateNameError", "GemError", "FeatureSpec", "PooledFeature", "Batch", "DistEnv",
     "offsets_of", "time_buckets", "NextItemLossKernel", "next_item_loss", "unit_rows", "unit_rows_vjp", "L2_EPS",
     "to_device_async"],
)  # fmt: skip
def test_the_public_module_exports_what_plugins_reached_into_the_core_for(name):
    assert name in api.__all__ and hasattr(api, name)
