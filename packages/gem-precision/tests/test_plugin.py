"""plugin.py registers every scheme and policy of the package, through the core's plugin manager."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import gem_precision.plugin as plugin
from gem_model.components import ActivationPolicy, ComponentConfig, PrecisionScheme
from gem_model.plugins import GemPluginManager

SCHEMES = {"fp32", "bf16", "fp8_tensorwise", "fp8_rowwise", "mxfp8"}
POLICIES = {"none", "checkpoint_full", "checkpoint_selective", "fp8_saved"}


@pytest.fixture(scope="module")
def pm() -> GemPluginManager:
    return GemPluginManager(autoload=False, plugins=[plugin])


def test_registers_every_name(pm: GemPluginManager) -> None:
    assert set(pm.precision_schemes.names()) == SCHEMES
    assert set(pm.activation_policies.names()) == POLICIES


@pytest.mark.parametrize(
    ("registry", "base"), [("precision_schemes", PrecisionScheme), ("activation_policies", ActivationPolicy)]
)
def test_classes_have_strict_configs(pm: GemPluginManager, registry: str, base: type) -> None:
    for name, entry in getattr(pm, registry).entries().items():
        cls = entry.cls
        assert issubclass(cls, base) and cls.name == name
        assert issubclass(cls.Config, ComponentConfig) and cls.Config.model_config.get("extra") == "forbid"
        instance = cls(cls.Config())
        assert instance.config == cls.Config()
        with pytest.raises(ValueError):
            cls.Config(not_an_option=1)


def test_plugin_imports_no_triton_and_no_cuda() -> None:
    code = (
        "import sys, gem_precision.plugin as p\n"
        "p.gem_register_precision_schemes(); p.gem_register_activation_policies()\n"
        "assert 'triton' not in sys.modules, 'plugin imported triton'\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
