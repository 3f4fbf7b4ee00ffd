"""The precision policy over the whole matrix: scheme x overrides x min_dim x activation policy x
attention kernel, each trained for two steps on a tiny model, or refused before training.

Every combination trains here on the CPU (the fp8 and MX schemes through their emulated backends,
which quantize bit for bit like the native ones); a run that cannot train must be refused when it
is built, with the conflict named, and never fail in the middle of a step.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gem_model.config_io import load_config
from gem_model.distributed import init_distributed, teardown
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components
from gem_model.train.run import Run

WORKER = Path(__file__).with_name("precision_matrix.py")
sys.path.insert(0, str(WORKER.parent))
from precision_matrix import MIN_DIMS, OVERRIDES, POLICIES, SCHEMES, TINY  # noqa: E402


def walk(kernel: str, schemes: list[str]) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GEM_DISABLE_PLUGIN_AUTOLOAD", None)
    if kernel == "triton":
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, str(WORKER), kernel, *schemes], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line[len("MATRIX ") :]) for line in proc.stdout.splitlines() if line.startswith("MATRIX ")]


# the Triton kernels run in their interpreter here: one test (and process) per scheme keeps each short
WALKS = [("torch", SCHEMES), *(("triton", [scheme]) for scheme in SCHEMES)]


@pytest.mark.parametrize(("kernel", "schemes"), WALKS, ids=[f"{k}-{'all' if len(s) > 1 else s[0]}" for k, s in WALKS])
def test_every_combination_trains_with_activations_in_the_schemes_dtype(kernel: str, schemes: list[str]) -> None:
    results = walk(kernel, schemes)
    assert len(results) == len(schemes) * len(OVERRIDES) * len(MIN_DIMS) * len(POLICIES)
    assert sorted({r["scheme"] for r in results}) == sorted(schemes)
    for r in results:
        case = {k: r[k] for k in ("kernel", "scheme", "overrides", "min_dim", "policy")}
        assert r["outcome"] == "trained", (case, r.get("error"))
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"]), case
        want = "float32" if r["scheme"] == "fp32" else "bfloat16"
        assert r["activation_dtype"] == want, case
        # the kernels, every linear (converted or kept in fp32) and the norms see only that dtype
        for kind in ("attention_in", "linear_in", "linear_out", "norm_in"):
            assert r["dtypes"][kind] == [want], (case, kind, r["dtypes"])
        # fp8_saved compresses in the fused block's kernels (triton), through its hooks elsewhere
        in_kernels = r["policy"] == "fp8_saved" and kernel == "triton"
        assert (r["kernel_forwards"] > 0) == in_kernels, case


def build(tmp_path: Path, *overrides: str) -> Run:
    config = load_config(None, [*TINY, f"trainer.output_dir={tmp_path}/{{name}}", *overrides])
    pm = GemPluginManager()
    components = resolve_components(config, pm)
    env = init_distributed("cpu")
    try:
        return Run(config, pm, components, env)
    finally:
        teardown(env, clean=True)


def test_a_backend_the_device_lacks_is_refused_before_training(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"precision: blocks\.0\.uvqk under scheme 'fp8_rowwise' cannot run on cpu"):
        build(tmp_path, "precision.scheme=fp8_rowwise", "precision.scheme.options.backend=native")


def test_activation_dtype_can_be_set_apart_from_the_scheme(tmp_path: Path) -> None:
    run = build(tmp_path, "precision.scheme=bf16", "precision.activation_dtype=float32")
    assert run.preparation.precision.activation_dtype == torch.float32
    assert run.model.activation_dtype == torch.float32
    run = build(tmp_path, "precision.scheme=bf16", "precision.min_dim=16")
    policy = run.preparation.precision
    assert policy.activation_dtype == torch.bfloat16 and policy.plan["dense_proj"] is None
    assert "kept in float32: dense_proj" in policy.describe()
    assert policy.fsdp_mixed_precision() == {
        "param_dtype": None,
        "reduce_dtype": torch.float32,
        "output_dtype": torch.bfloat16,
    }
