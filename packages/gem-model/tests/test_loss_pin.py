"""The tiny run's losses, pinned bit for bit: recorded before the core seams (layout, plan/apply,
train pipelines, run context) went in, and reproduced by them.

One process (``inline_single``) in this process; two gloo processes under the ``inline_replicated``
layout (``tp=2``, no data parallelism): both ranks read the whole global batch (the loader shards
by the data-parallel rank, not the rank), nothing is reduced (the loss group is one rank) and the
loss is normalised by the loss group's size, so they reproduce the one-process losses exactly.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

from gem_model import testing

# 4 steps of testing.INLINE_OVERRIDES (seed 0), per CPU family (testing.assert_pinned)
AVX2 = "AVX2 CI machine, 4ddf59e"
SPR = "AVX-512 + AMX (Sapphire Rapids), b9cca1e"
AMD = "AVX-512 AMD EPYC (no AMX), cb0a341"
PINNED = {
    AVX2: ["0x1.1d7bac27b9612p+3", "0x1.0358afcb65b2ep+3", "0x1.05f21f61642c8p+3", "0x1.043e843b9611ap+3"],
    SPR: ["0x1.1d7bac27b9612p+3", "0x1.0358b00b65b2ep+3", "0x1.05f21f61642c8p+3", "0x1.043e83211a7bap+3"],
    AMD: ["0x1.1d7bac47b9612p+3", "0x1.0358b18c46231p+3", "0x1.05f2213c4a33fp+3", "0x1.043e843b9611ap+3"],
}
WHAT = "packages/gem-model/tests/test_loss_pin.py PINNED"
RUN = ["trainer.checkpoint_at_end=false"]


def test_one_process_reproduces_the_pinned_losses(tmp_path):
    # one thread, as each rank of the two-process run below (OMP_NUM_THREADS=1): CPU reductions split
    # over more threads round differently on some machines (the AMD set's step 3 did, on two cores)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run = testing.tiny_run(*RUN, output_dir=tmp_path / "one", steps=4)
    finally:
        torch.set_num_threads(threads)
    testing.assert_pinned([x.hex() for x in run.losses], PINNED, WHAT)


@pytest.mark.multiprocess
def test_two_tensor_parallel_ranks_reproduce_the_pinned_losses(tmp_path):
    env = {**os.environ, "GEM_PLUGINS": "gem_model.testing", "GEM_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1"}
    args = [*testing.INLINE_OVERRIDES, *RUN, "trainer.steps=4", "parallel.planner=inline_replicated"]
    cmd = [sys.executable, "-m", "gem_model", "run", "--nproc", "2", *args, f"trainer.output_dir={tmp_path}/two"]
    proc = testing.run_until(cmd, env=env, timeout_s=600)  # a hang fails with both ranks' stacks
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tp=2 (2 ranks)" in proc.stdout
    losses = [json.loads(x)["step_loss"] for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    testing.assert_pinned([x.hex() for x in losses], PINNED, WHAT)
