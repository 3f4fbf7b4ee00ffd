"""A third-party plugin package, pip-installed on its own, is selected by name from a run config."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_installed_example_plugin_is_used_from_a_config(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(target),
         str(ROOT / "examples" / "gem-plugin-example")],
        check=True,
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")])}
    env.pop("GEM_DISABLE_PLUGIN_AUTOLOAD", None)
    plugins = subprocess.run([sys.executable, "-m", "gem_model", "plugins"], env=env, capture_output=True, text=True, check=True)
    assert "gem-plugin-example 0.1.0" in plugins.stdout and "fp16_gemm" in plugins.stdout

    config = tmp_path / "run.yaml"
    config.write_text(
        "name: example\n"
        "precision:\n  scheme: {name: fp16_gemm, options: {output_fp32: true}}\n"
        f"trainer: {{steps: 3, progress: false, output_dir: '{tmp_path}/out'}}\n"
        "data: {global_batch_size: 16}\n"
    )
    run = subprocess.run([sys.executable, "-m", "gem_model", "run", "-c", str(config)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "precision" in run.stdout and "fp16_gemm" in run.stdout

    bad = subprocess.run(
        [sys.executable, "-m", "gem_model", "run", "-c", str(config), "precision.scheme.options.output_fp64=true"],
        env=env, capture_output=True, text=True,
    )
    assert bad.returncode == 2 and "precision.scheme.options.output_fp64" in bad.stderr
