"""The ``sparse_dist`` train pipeline (torchrec's ``TrainPipelineSparseDist``, cut into the core's
staged step) on 2 gloo processes through gem-parallel's ``torchrec_ddp`` planner.

Starting a batch's embedding input distribution a step early moves ids, not numbers, so the
losses must equal the ``sequential`` pipeline's bit for bit: steps 1 and 2 give comm_runs.PINNED
(the losses gem-parallel's test_loss_pin.py pins), step 3 is poisoned (NaN) and its update skipped
by the core (``trainer.non_finite: skip``: no backward, no step, the pipeline's queue must still
move on), step 4 gives the ``sequential`` pipeline's loss after that skip. The run uses
``sparse_dist_probe`` (comm_sparse_probe.py): ``sparse_dist`` itself plus a reading of torchrec's
pipeline contexts around every stage, which shows the input dist of batch i+1 in flight during
batch i's forward and backward.
"""

from __future__ import annotations

import json

import pytest
from comm_runs import SKIPPED_PINNED, step_losses

import gem_comm.plugin
from gem_comm.sparse_dist import SparseDistPipeline, StagedSparseDist
from gem_model.testing import assert_pinned, tiny_run

TABLES = ["sparse.ebc", "sparse.ec"]


@pytest.mark.multiprocess
def test_sparse_dist_gives_the_sequential_losses_and_runs_the_input_dist_ahead(planner_runs):
    run = planner_runs["sparse_dist"]
    assert run.returncode == 0, run.stderr[-4000:]
    what = "comm_runs.SKIPPED_PINNED (measure them with trainer.pipeline=sequential, not sparse_dist)"
    assert_pinned([x.hex() for x in step_losses(run.out)], SKIPPED_PINNED, what, steps=(1, 2, 4))
    for rank in (0, 1):
        steps = json.loads((run.out / f"rank{rank}.json").read_text())
        assert len(steps) == 4
        for i, s in enumerate(steps):
            last = i == len(steps) - 1
            assert s["forwards"] == [f"PipelinedForward:{t}" for t in TABLES]
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


def test_sparse_dist_is_refused_without_a_torchrec_sharded_model(tmp_path):
    with pytest.raises(ValueError, match="trainer.pipeline 'sparse_dist'.*parallel.planner 'torchrec_ddp'"):
        tiny_run("trainer.pipeline=sparse_dist", output_dir=tmp_path, steps=1, plugins=[gem_comm.plugin])


def test_torchrecs_own_progress_is_closed():
    assert SparseDistPipeline.name == "sparse_dist"
    with pytest.raises(TypeError, match="would skip the core's loss reduction"):
        StagedSparseDist.progress(None, iter(()))  # type: ignore[arg-type]
