"""Whole 2-process runs through gem-parallel's ``torchrec_ddp`` planner (the ``all`` environment).

``overlap`` must reproduce the 2-process losses that gem-parallel's test_loss_pin.py pins bit for
bit (DDP's own arithmetic, with the strategy's bucketing passed through ``ddp_kwargs``); ``quantized``
(bf16 dense gradients and bf16 qcomms for the embedding all-to-all, forward and backward) stays
within 5e-3 relative of them over 4 steps (bf16 rounds by up to 2**-8 = 3.9e-3) and differs from them. Both report their bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("gem_parallel")
pytestmark = pytest.mark.multiprocess

# gem-parallel's tests/conftest.py REFERENCE overrides and test_loss_pin.py's pinned losses
REFERENCE = [
    "kernels.jagged_attention=loop", "kernels.norm_gate=loop", "precision.scheme=inline_fp32",
    "activation.policy=inline_none", "trainer.progress=false", "trainer.log_every=1",
    "data.global_batch_size=16", "data.source.options.max_len=15", "model.max_seq_len=16",
    "trainer.steps=4", "trainer.checkpoint_at_end=false", "trainer.eval_at_end=false",
    "parallel.planner=torchrec_ddp", "callbacks=[{name: comm_report}]",
]  # fmt: skip
PINNED = ["0x1.1dfc7c48d3dcbp+3", "0x1.f38f95fa4d269p+2", "0x1.05a5b3d1dae60p+3", "0x1.09b4381d3dcb0p+3"]


def _start(strategy: str, out: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "gem_model", "run", "--nproc", "2", *REFERENCE, f"comm.strategy={strategy}", f"trainer.output_dir={out}"]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_overlap_and_quantized_through_the_planner(tmp_path):
    procs = {name: _start(name, tmp_path / name) for name in ("overlap", "quantized")}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        losses = [json.loads(x)["step_loss"] for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        out[name] = (losses, stdout)
    assert [x.hex() for x in out["overlap"][0]] == PINNED
    pinned = [float.fromhex(x) for x in PINNED]
    quantized = out["quantized"][0]
    assert quantized != pinned
    assert all(abs(q - p) <= 5e-3 * abs(p) for q, p in zip(quantized, pinned, strict=True)), (quantized, pinned)
    assert "dense.all_reduce.bytes" in out["overlap"][1].split("== communication")[1]
    report = out["quantized"][1].split("== communication")[1]
    assert "dense.all_to_all.bytes" in report and "dense.all_gather.bytes" in report
