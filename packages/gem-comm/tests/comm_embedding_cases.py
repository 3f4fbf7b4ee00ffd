"""What the embedding-qcomms test runs in each process: torchrec's sharded EmbeddingBagCollection
over gloo, with the codecs a ``quantized`` strategy asks for, wired as gem-parallel's sharders do."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gem_comm.measure import CommMeter, count_all_to_all
from gem_comm.quantized import QuantizedComm
from gem_model.distributed import DistEnv

DIM, TABLES = 8, 2
VARIANTS = {
    "fp32": {"embedding_forward": "fp32", "embedding_backward": "fp32"},
    "bf16": {},
    "fp16": {"embedding_forward": "fp16", "embedding_backward": "fp16"},
}


def _sharded(qcomms: Any, world: int) -> Any:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import get_qcomm_codecs_registry
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=32, feature_names=[f"f{i}"]) for i in range(TABLES)]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})
    sharders = [EmbeddingBagCollectionSharder(qcomm_codecs_registry=get_qcomm_codecs_registry(qcomms))]
    constraints = {t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for t in tables}
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints)
    plan = planner.collective_plan(ebc, sharders, dist.group.WORLD)
    env = ShardingEnv.from_process_group(dist.group.WORLD)
    return DistributedModelParallel(ebc, env=env, device=torch.device("cpu"), plan=plan, sharders=sharders)


def run(rank: int, world: int) -> dict[str, Any]:
    from torchrec import KeyedJaggedTensor

    out: dict[str, Any] = {}
    for name, options in VARIANTS.items():
        comm = QuantizedComm(QuantizedComm.Config(**options))
        comm.setup(DistEnv(rank, world, rank, torch.device("cpu"), "gloo"))
        model = _sharded(comm.embedding_qcomms(), world)
        meter = CommMeter()
        gen = torch.Generator().manual_seed(rank)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(TABLES)],
            values=torch.randint(0, 32, (12,), generator=gen),
            lengths=torch.tensor([1, 2, 3, 2, 1, 3]),
        )
        with count_all_to_all(meter):
            pooled = model(kjt).values()
            pooled.sum().backward()
        out[name] = {"pooled": pooled.detach().clone(), "measured": meter.totals()}
    return out
