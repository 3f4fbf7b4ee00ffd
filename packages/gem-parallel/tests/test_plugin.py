"""Registration and the planners' own checks."""

from __future__ import annotations

import pytest
import torch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

import gem_parallel.plugin
from gem_model import testing
from gem_model.components import SparseOptimizerSpec
from gem_model.config import ModelConfig, TrainerConfig
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.distributed import DistEnv
from gem_model.model.gem import GemModel
from gem_model.plugins import GemPluginManager
from gem_model.train.optim import sparse_optimizer_spec
from gem_parallel.sharded import TorchrecDDPConfig, TorchrecDDPPlanner
from gem_parallel.single import SinglePlanner

SPEC = SparseOptimizerSpec(RowWiseAdagrad, {"lr": 0.1})


def model() -> GemModel:
    src = SyntheticSource(SyntheticConfig(max_len=15))
    return GemModel(ModelConfig(max_seq_len=16), src.feature_spec(), attention=testing.LoopAttention(), norm_gate=testing.TorchNormGate())


def env(world: int = 1, backend: str | None = None) -> DistEnv:
    return DistEnv(0, world, 0, torch.device("cpu"), backend)


def test_plugin_registers_both_planners():
    pm = GemPluginManager(autoload=False, plugins=[gem_parallel.plugin])
    assert pm.parallel_planners.names() == ["auto", "fsdp", "single", "torchrec_ddp"]
    assert pm.parallel_planners.get("single").cls is SinglePlanner
    assert pm.parallel_planners.get("torchrec_ddp").cls is TorchrecDDPPlanner


def test_single_keeps_tables_out_of_the_dense_optimizer():
    prepared = SinglePlanner().prepare(model(), env=env(), comm=testing.PlainComm(), sparse_optimizer=SPEC)
    names = [n for n, _ in prepared.dense_parameters]
    assert names and not any(n.startswith("sparse.") for n in names)
    tables = set(prepared.sparse_optimizer.params)
    assert "sparse.ec.embeddings.item.weight" in tables and not prepared.sparse_optimizer_fused
    assert SinglePlanner.max_world_size == 1


def test_single_refuses_several_processes():
    with pytest.raises(ValueError, match="runs one process"):
        SinglePlanner().prepare(model(), env=env(2, "gloo"), comm=testing.PlainComm(), sparse_optimizer=SPEC)


def test_torchrec_ddp_needs_a_process_group():
    with pytest.raises(ValueError, match="needs a process group"):
        TorchrecDDPPlanner().prepare(model(), env=env(), comm=testing.PlainComm(), sparse_optimizer=SPEC)


def test_torchrec_ddp_options_are_validated():
    assert TorchrecDDPConfig(sharding_types=["row_wise"]).sharding_types == ["row_wise"]
    with pytest.raises(ValueError):
        TorchrecDDPConfig(sharding_types=["diagonal"])


def test_torchrec_ddp_refuses_a_table_optimizer_fbgemm_cannot_fuse_on_cpu():
    adam = sparse_optimizer_spec(TrainerConfig(sparse_optimizer="adam"))
    with pytest.raises(ValueError, match="'adam': FBGEMM's fused table update has no CPU kernel"):
        TorchrecDDPPlanner().prepare(model(), env=env(2, "gloo"), comm=testing.PlainComm(), sparse_optimizer=adam)
