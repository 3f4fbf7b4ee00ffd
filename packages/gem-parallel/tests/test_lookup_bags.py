"""The sequence lookup in even bags (``model.lookup_bags_per_sample``) through torchrec's sharded tables:
FBGEMM's fused TBE on the CPU, one gloo rank. The same rows come back and the fused table update is
the same, bit for bit, as with the batch's own bags."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torchrec.distributed.types import ShardedModule

from gem_model import testing
from gem_model.api import PlannerContext
from gem_model.config import ModelConfig, TrainerConfig
from gem_model.data.batch import SEQUENCE_KEYS
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.distributed import DistEnv
from gem_model.model.gem import GemModel
from gem_model.train.optim import sparse_optimizer_spec
from gem_parallel.sharded import TorchrecDDPPlanner


def _sharded(source: SyntheticSource, bags: int | None):
    model = GemModel(ModelConfig(max_seq_len=48, lookup_bags_per_sample=bags), source.feature_spec(),
                     attention=testing.LoopAttention(), norm_gate=testing.TorchNormGate())  # fmt: skip
    env = DistEnv(0, 1, 0, torch.device("cpu"), "gloo")
    planner = TorchrecDDPPlanner()
    ctx = PlannerContext(env, planner.layout(env), testing.PlainComm(), sparse_optimizer_spec(TrainerConfig()))
    prepared = planner.apply(model, planner.plan(model, ctx), ctx)
    assert any(isinstance(m, ShardedModule) for m in prepared.module.modules())
    return model  # torchrec put the sharded tables into the model itself


def _tables(model: GemModel) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in model.sparse.ec.state_dict().items():
        shards = value.local_shards() if hasattr(value, "local_shards") else None
        out[name] = shards[0].tensor.clone() if shards is not None else value.clone()
    return out


def test_even_bags_give_the_sharded_lookup_and_its_fused_update_the_same_numbers(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        source = SyntheticSource(SyntheticConfig(max_len=47, num_negatives=5, length_exponent=0.3))
        batch = source.make_batch(0, 6, torch.arange(6))
        whole, even = _sharded(source, None), _sharded(source, 3)
        before = _tables(whole)
        assert before.keys() == _tables(even).keys()
        assert all(torch.equal(before[k], v) for k, v in _tables(even).items())  # the same seed: the same tables
        grads = None
        outs = {}
        for name, model in (("whole", whole), ("even", even)):
            seq, _ = model.sparse(batch.sequence, batch.pooled)
            outs[name] = seq
            if grads is None:  # fresh random gradients, the same for both
                g = torch.Generator().manual_seed(5)
                grads = {k: torch.randn(jt.values().shape, generator=g) for k, jt in seq.items()}
            torch.autograd.backward([seq[k].values() for k in grads], [grads[k] for k in grads])
        for key in SEQUENCE_KEYS:
            w, e = outs["whole"][key], outs["even"][key]
            assert torch.equal(w.values(), e.values()), key
            assert torch.equal(e.lengths(), batch.sequence[key].lengths()), key  # the batch's own bags
        after_whole, after_even = _tables(whole), _tables(even)
        assert any(not torch.equal(before[k], after_whole[k]) for k in before)  # the fused update ran
        for k in before:
            assert torch.equal(after_whole[k], after_even[k]), k
    finally:
        dist.destroy_process_group()
