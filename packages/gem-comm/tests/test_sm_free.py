"""``sm_free`` is NCCL-only: on gloo (and in one process) it is refused before training.

Its NCCL paths (CTA policy zero, CTA/CGA caps) need GPUs and are not run here; what is tested is
the refusal, the option validation and that the refusal comes before any step.
"""

from __future__ import annotations

import pytest
import torch

import gem_comm.plugin
from gem_comm.sm_free import SmFreeComm
from gem_model import testing
from gem_model.distributed import DistEnv


def test_refused_on_gloo_naming_the_option_and_why():
    comm = SmFreeComm()
    with pytest.raises(ValueError, match=r"comm.strategy 'sm_free' needs the NCCL backend.*'gloo' on cpu"):
        comm.setup(DistEnv(0, 2, 0, torch.device("cpu"), "gloo"))


def test_options_are_validated():
    assert SmFreeComm.Config(max_ctas=2).max_ctas == 2
    with pytest.raises(ValueError, match="greater than 0"):
        SmFreeComm.Config(max_ctas=0)


def test_a_run_is_refused_before_its_first_step(tmp_path):
    with pytest.raises(ValueError, match="sm_free"):
        testing.tiny_run("comm.strategy=sm_free", output_dir=tmp_path, steps=1, plugins=[gem_comm.plugin])
    assert not (tmp_path / "metrics.jsonl").exists()
