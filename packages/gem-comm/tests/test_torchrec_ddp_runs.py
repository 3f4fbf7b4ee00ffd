"""Whole 2-process runs through gem-parallel's ``torchrec_ddp`` planner (the ``all`` environment).

``overlap`` must reproduce the 2-process losses that gem-parallel's test_loss_pin.py pins bit for
bit (DDP's own arithmetic, with the strategy's bucketing passed through ``ddp_kwargs``); ``quantized``
(bf16 dense gradients and bf16 qcomms for the embedding all-to-all, forward and backward) stays
within 5e-3 relative of them over 4 steps (bf16 rounds by up to 2**-8 = 3.9e-3) and differs from them. Both report their bytes.
"""

from __future__ import annotations

import pytest
from comm_runs import PINNED, step_losses

from gem_model.testing import assert_pinned

pytestmark = pytest.mark.multiprocess


def test_overlap_and_quantized_through_the_planner(planner_runs):
    out = {}
    for name in ("overlap", "quantized"):
        run = planner_runs[name]
        assert run.returncode == 0, run.stderr[-4000:]
        out[name] = (step_losses(run.out), run.stdout)
    family = assert_pinned([x.hex() for x in out["overlap"][0]], PINNED, "packages/gem-comm/tests/comm_runs.py PINNED")
    pinned = [float.fromhex(x) for x in PINNED[family]]
    quantized = out["quantized"][0]
    assert quantized != pinned
    assert all(abs(q - p) <= 5e-3 * abs(p) for q, p in zip(quantized, pinned, strict=True)), (quantized, pinned)
    assert "dense.all_reduce.bytes" in out["overlap"][1].split("== communication")[1]
    report = out["quantized"][1].split("== communication")[1]
    assert "dense.all_to_all.bytes" in report and "dense.all_gather.bytes" in report
