"""The ``sparse_dist`` train pipeline (torchrec's ``TrainPipelineSparseDist``, cut into the core's
staged step): what it refuses and closes in one process. Its 2-process run through gem-parallel's
``torchrec_ddp`` planner (the losses of the ``sequential`` pipeline bit for bit, the input dist of
batch i+1 in flight during batch i) needs both packages: ``tests/test_comm_through_planner.py``.
"""

from __future__ import annotations

import pytest

import gem_comm.plugin
from gem_comm.sparse_dist import SparseDistPipeline, StagedSparseDist
from gem_model.testing import tiny_run


def test_sparse_dist_is_refused_without_a_torchrec_sharded_model(tmp_path):
    with pytest.raises(ValueError, match="trainer.pipeline 'sparse_dist'.*parallel.planner 'torchrec_ddp'"):
        tiny_run("trainer.pipeline=sparse_dist", output_dir=tmp_path, steps=1, plugins=[gem_comm.plugin])


def test_torchrecs_own_progress_is_closed():
    assert SparseDistPipeline.name == "sparse_dist"
    with pytest.raises(TypeError, match="would skip the core's loss reduction"):
        StagedSparseDist.progress(None, iter(()))  # type: ignore[arg-type]
