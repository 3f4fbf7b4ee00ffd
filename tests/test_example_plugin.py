"""A third-party plugin package, pip-installed on its own, is selected by name from a run config.

Three tests share one install, one ``gem_model`` process each (a process imports torch and every plugin,
~20 s on a 2-core machine: the three in one test took up to 73 s on a loaded one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], Path]:
    """The example plugin pip-installed into a folder of its own; the environment that sees it, and a
    run config that names its precision scheme."""
    tmp = tmp_path_factory.mktemp("example_plugin")
    target = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(ROOT / "examples" / "gem-plugin-example")],
        check=True,
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    env.pop("GEM_DISABLE_PLUGIN_AUTOLOAD", None)
    config = tmp / "run.yaml"
    config.write_text(
        "name: example\n"
        "precision:\n  scheme: {name: fp16_gemm, options: {output_fp32: true}}\n"
        f"trainer: {{steps: 3, progress: false, output_dir: '{tmp}/out'}}\n"
        "data: {global_batch_size: 16}\n"
    )
    return env, config


def test_installed_example_plugin_is_listed(installed):
    env, _ = installed
    plugins = subprocess.run([sys.executable, "-m", "gem_model", "plugins"], env=env, capture_output=True, text=True, check=True)
    assert "gem-plugin-example 0.1.0" in plugins.stdout and "fp16_gemm" in plugins.stdout


def test_installed_example_plugins_options_are_validated(installed):
    env, config = installed
    bad = subprocess.run(
        [sys.executable, "-m", "gem_model", "run", "-c", str(config), "precision.scheme.options.output_fp64=true"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert bad.returncode == 2 and "precision.scheme.options.output_fp64" in bad.stderr


def test_installed_example_plugin_is_used_from_a_config(installed):
    env, config = installed
    run = subprocess.run([sys.executable, "-m", "gem_model", "run", "-c", str(config)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "precision" in run.stdout and "fp16_gemm" in run.stdout
