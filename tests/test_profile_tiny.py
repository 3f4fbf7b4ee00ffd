"""`gem-train profile` on configs/tiny.yaml with every package installed: the core's sections, the
plugins' (numerics from gem-precision, comm_measured from gem-comm), the outputs, and `report`."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_profile_of_the_tiny_config_then_report(tmp_path: Path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("GEM_DISABLE_PLUGIN_AUTOLOAD", None)
    out = tmp_path / "profile"
    args = ["profile", "-c", str(ROOT / "configs" / "tiny.yaml"), "--out", str(out), "--batches", "1",
            "--warmup", "1", "--steps", "1"]  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "gem_model", *args], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "profile.json").read_text())
    names = [s["name"] for s in data["sections"]]
    assert names[:5] == ["sequences", "balance", "step_time", "memory", "communication"]  # the core's, in order
    assert sorted(names[5:7]) == ["comm_measured", "numerics"]  # the plugins', in their registration order
    assert names[7:] == ["mfu", "recommendations"]
    sections = {s["name"]: s for s in data["sections"]}
    policies = sections["memory"]["summary"]["activations"]
    assert set(policies) == {"none", "checkpoint_full", "checkpoint_selective", "fp8_saved"}
    assert policies["checkpoint_full"]["saved"] < policies["none"]["saved"]  # recomputed, not kept
    assert set(sections["balance"]["summary"]["imbalance"]) == {"round_robin", "seq_balanced"}
    assert sections["numerics"]["summary"]["schemes"][:5] == ["mxfp8", "fp8_rowwise", "fp8_tensorwise", "bf16", "fp32"]
    assert sections["mfu"]["summary"]["gemm_dtype"] == "float32"
    if (out / "lengths.png").exists():  # gem-model[report] installed
        assert struct.unpack(">II", (out / "memory.png").read_bytes()[16:24]) == (800, 450)
    from gem_model.cli import main

    html = (out / "profile.html").read_text()
    (out / "profile.html").unlink()
    assert main(["report", str(out)]) == 0
    assert (out / "profile.html").read_text() == html
