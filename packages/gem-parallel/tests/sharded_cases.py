"""A small GemModel with torchrec's sharded tables on one gloo rank (FBGEMM's fused TBE on the CPU), and its
tables' weights: what the sharded-lookup tests build on. The caller starts the process group."""

from __future__ import annotations

import torch
from torchrec.distributed.types import ShardedModule

from gem_model import testing
from gem_model.api import PlannerContext
from gem_model.config import ModelConfig, TrainerConfig
from gem_model.data.synthetic import SyntheticSource
from gem_model.distributed import DistEnv
from gem_model.model.gem import GemModel
from gem_model.train.optim import sparse_optimizer_spec
from gem_parallel.sharded import TorchrecDDPPlanner


def sharded_model(source: SyntheticSource, bags: int | None) -> GemModel:
    """The model of ``source``'s features (``lookup_bags_per_sample=bags``), its tables sharded by the
    ``torchrec_ddp`` planner (torchrec puts the sharded tables into the model itself)."""
    model = GemModel(ModelConfig(max_seq_len=48, lookup_bags_per_sample=bags), source.feature_spec(),
                     attention=testing.LoopAttention(), norm_gate=testing.TorchNormGate())  # fmt: skip
    env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    planner = TorchrecDDPPlanner()
    ctx = PlannerContext(env, planner.layout(env), testing.PlainComm(), sparse_optimizer_spec(TrainerConfig()))
    prepared = planner.apply(model, planner.plan(model, ctx), ctx)
    assert any(isinstance(m, ShardedModule) for m in prepared.module.modules())
    return model


def table_weights(model: GemModel) -> dict[str, torch.Tensor]:
    """A copy of each sequence table's (local shard's) weights."""
    out = {}
    for name, value in model.sparse.ec.state_dict().items():
        shards = value.local_shards() if hasattr(value, "local_shards") else None
        out[name] = shards[0].tensor.clone() if shards is not None else value.clone()
    return out
