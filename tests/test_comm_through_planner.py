"""gem-comm's strategies and its ``sparse_dist`` pipeline in whole 2-process runs through gem-parallel's
``torchrec_ddp`` planner (both packages: the ``all`` environment), the runs of comm_runs.RUNS.

``overlap`` must reproduce the 2-process losses that gem-parallel's test_loss_pin.py pins bit for
bit (DDP's own arithmetic, with the strategy's bucketing passed through ``ddp_kwargs``); ``quantized``
(bf16 dense gradients and bf16 qcomms for the embedding all-to-all, forward and backward) stays
within 5e-3 relative of them over 4 steps (bf16 rounds by up to 2**-8 = 3.9e-3) and differs from them. Both report their bytes.

``sparse_dist`` (torchrec's ``TrainPipelineSparseDist``, cut into the core's staged step) starts a
batch's embedding input distribution a step early: that moves ids, not numbers, so the losses must
equal the ``sequential`` pipeline's bit for bit: steps 1 and 2 give comm_runs.PINNED, step 3 is
poisoned (NaN) and its update skipped by the core (``trainer.non_finite: skip``: no backward, no step,
the pipeline's queue must still move on), step 4 gives the ``sequential`` pipeline's loss after that
skip. The run uses ``sparse_dist_probe`` (comm_sparse_probe.py): ``sparse_dist`` itself plus a reading
of torchrec's pipeline contexts around every stage, which shows the input dist of batch i+1 in flight
during batch i's forward and backward.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib: comm_runs beside this file
from comm_runs import PINNED, SKIPPED_PINNED, run_all, start, step_losses

from gem_model.testing import assert_pinned, finish

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]  # 2-process runs: ~12 s of CPU each

TABLES = ["sparse.ebc", "sparse.ec"]


def test_overlap_through_the_planner(tmp_path):
    run = run_all(tmp_path, ["overlap"])["overlap"]
    assert run.returncode == 0, run.stderr[-4000:]
    assert_pinned([x.hex() for x in step_losses(run.out)], PINNED, "tests/comm_runs.py PINNED")
    assert "dense.all_reduce.bytes" in run.stdout.split("== communication")[1]


def test_quantized_through_the_planner(tmp_path):
    """Its own test (each run alone stays well under a minute on the CI matrix): the quantized
    collectives change the losses, within 5e-3 of the pinned full-precision ones of every CPU family
    (the families' pins differ in their last bits only)."""
    run = run_all(tmp_path, ["quantized"])["quantized"]
    assert run.returncode == 0, run.stderr[-4000:]
    quantized = step_losses(run.out)
    for family, pins in PINNED.items():
        pinned = [float.fromhex(x) for x in pins]
        assert quantized != pinned, family
        assert all(abs(q - p) <= 5e-3 * abs(p) for q, p in zip(quantized, pinned, strict=True)), (family, quantized)
    report = run.stdout.split("== communication")[1]
    assert "dense.all_to_all.bytes" in report and "dense.all_gather.bytes" in report


def test_sparse_dist_gives_the_sequential_losses_and_runs_the_input_dist_ahead(tmp_path):
    run = run_all(tmp_path, ["sparse_dist"])["sparse_dist"]
    assert run.returncode == 0, run.stderr[-4000:]
    what = "comm_runs.SKIPPED_PINNED (measure them with trainer.pipeline=sequential, not sparse_dist)"
    assert_pinned([x.hex() for x in step_losses(run.out)], SKIPPED_PINNED, what, steps=(1, 2, 4))
    for rank in (0, 1):
        steps = json.loads((run.out / f"rank{rank}.json").read_text())
        assert len(steps) == 4
        for i, s in enumerate(steps):
            last = i == len(steps) - 1
            assert s["forwards"] == [f"PipelinedForward:{t}" for t in TABLES]
            assert s["lookup_stride"] == 32 * s["batch_size"]  # model.lookup_bags_per_sample's even bags
            before, after = s["before_forward"], s["after_forward"]
            # batch i's data all-to-alls were started before its step and its forward took them
            assert before["current_requests"] == TABLES and after["current_requests"] == []
            # batches i, i+1, i+2 queued (the feed ends at trainer.steps)
            assert before["queued"] == min(3, len(steps) - i)
            assert before["next_splits_started"] is (not last)
            assert after["next_requests"] == []
            if i == 2:  # the skipped update: no backward
                assert "after_backward" not in s
            else:  # batch i+1's data all-to-alls start between batch i's forward and backward
                assert s["after_backward"]["next_requests"] == ([] if last else TABLES)


def test_quantized_all_to_alls_refuse_lookups_in_another_dtype(tmp_path):
    """FBGEMM's qcomm codecs take float32 lookups (a float16 lookup overflows the bf16 codec's clamp):
    the planner says so, naming the option and the strategy, before any table is sharded (exit 2)."""
    proc = start(tmp_path / "q16", "comm.strategy=quantized", "parallel.planner.options.table_output_dtype=float16")
    stderr = finish(proc, timeout_s=600).stderr  # a hang fails with the ranks' stacks
    assert proc.returncode != 0
    message = ("parallel.planner.options.table_output_dtype: comm.strategy 'quantized' quantizes the embedding "
               "all-to-alls, whose codecs take float32 lookups")  # fmt: skip
    assert message in stderr, stderr[-3000:]
    assert "exitcode  : 2" in stderr
