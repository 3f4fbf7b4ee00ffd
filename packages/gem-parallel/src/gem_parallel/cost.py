"""Bytes and seconds of one step's communication per dimension, and memory per rank.

An analytic model, the same for every candidate layout so that they can be compared:

- ring collectives (all-gather, reduce-scatter, all-reduce) run at the slowest link of the group:
  NVLink when the whole group is inside a node, the network otherwise (NCCL drives one ring per
  NIC, so a group that spans nodes moves at the NIC's bandwidth), and pay ``ceil(log2 n)`` message
  latencies each (2x for an all-reduce), as NCCL's tree and NVLS algorithms do at scale;
- FSDP and HSDP run one collective per block (and one for the rest of the dense part), so their
  latencies count per block;
- an all-to-all sends to the peers inside the node over NVLink and to the others over the network
  at the same time, and pays one message latency per peer;
- the table replicas of the sparse groups are averaged by an all-reduce of each rank's shards
  every ``table_sync_every`` steps (torchrec's ``DMPCollection.sync``; ``fsdp`` averages them after
  every step, and the ``auto`` planner costs that);
- nothing overlaps with compute (an upper bound on exposed time; overlap is the comm strategy's job).

Bytes are those one rank sends per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from gem_model.api import ParallelDims
from gem_parallel.topology import Placement, Topology, place
from gem_parallel.workload import Workload

GB = 1e9


@dataclass(frozen=True)
class DimCost:
    """One dimension's share of a step."""

    dim: str
    degree: int
    link: str
    bytes_per_step: float
    seconds: float
    collectives: int
    what: str


@dataclass(frozen=True)
class MemoryPerRank:
    """Bytes one rank holds at the peak of a step."""

    dense_states: float
    dense_working: float
    activations: float
    tables: float
    embedding_buffers: float

    @property
    def total(self) -> float:
        return self.dense_states + self.dense_working + self.activations + self.tables + self.embedding_buffers

    def items(self) -> dict[str, float]:
        return {
            "dense_states": self.dense_states,
            "dense_working": self.dense_working,
            "activations": self.activations,
            "tables": self.tables,
            "embedding_buffers": self.embedding_buffers,
        }


@dataclass(frozen=True)
class StepCost:
    dims: ParallelDims
    """The degrees, with their mesh order and sparse groups."""
    per_dim: tuple[DimCost, ...]
    memory: MemoryPerRank
    placements: dict[str, Placement] = field(repr=False)

    @property
    def comm_seconds(self) -> float:
        return sum(c.seconds for c in self.per_dim)


def _bw(p: Placement, topo: Topology) -> tuple[float, float]:
    """(bandwidth, latency) of a ring collective over one group of ``p``."""
    if p.link == "nvlink":
        return topo.intra_node_bw, topo.intra_node_latency
    return topo.inter_node_bw, topo.inter_node_latency


def ring(p: Placement, topo: Topology, nbytes: float, *, allreduce: bool = False) -> tuple[float, float]:
    """(bytes sent, seconds) of an all-gather / reduce-scatter (or all-reduce) of ``nbytes`` per rank."""
    n = p.degree
    if n == 1 or nbytes <= 0:
        return 0.0, 0.0
    factor = (2.0 if allreduce else 1.0) * (n - 1) / n
    bw, lat = _bw(p, topo)
    steps = (2 if allreduce else 1) * math.ceil(math.log2(n))  # tree-like latency, as NCCL picks at scale
    return factor * nbytes, factor * nbytes / bw + steps * lat


def all_to_all(p: Placement, topo: Topology, nbytes: float) -> tuple[float, float]:
    """(bytes sent, seconds) of an all-to-all whose input is ``nbytes`` per rank, split evenly."""
    n = p.degree
    if n == 1 or nbytes <= 0:
        return 0.0, 0.0
    local = min(p.members_per_node, n)
    intra = nbytes * (local - 1) / n
    inter = nbytes * (n - local) / n
    t = max(intra / topo.intra_node_bw, inter / topo.inter_node_bw)
    t += (local - 1) * topo.intra_node_latency + (n - local) * topo.inter_node_latency
    return intra + inter, t


@dataclass(frozen=True)
class Lookups:
    """Per sample: ids looked up and embedding elements returned, for sequence and pooled tables."""

    seq_ids: float
    pooled_ids: float
    seq_elems: float
    pooled_elems: float

    @classmethod
    def of(cls, w: Workload) -> Lookups:
        seq = [t for t in w.tables if t.kind == "sequence"]
        pooled = [t for t in w.tables if t.kind == "pooled"]
        return cls(
            seq_ids=sum(w.ids_per_sample(t) for t in seq),
            pooled_ids=sum(w.ids_per_sample(t) for t in pooled),
            seq_elems=sum(w.ids_per_sample(t) * t.dim for t in seq),
            pooled_elems=float(sum(t.dim for t in pooled)),
        )


def estimate(
    dims: ParallelDims,
    topo: Topology,
    w: Workload,
    *,
    table_bytes_per_rank: float | None = None,
    lookups: Lookups | None = None,
) -> StepCost:
    """The step cost of ``w`` laid out as ``dims`` (in their mesh order) on ``topo``.

    ``table_bytes_per_rank``: the most any rank holds of the tables (default: an even split);
    ``lookups``: :meth:`Lookups.of` ``(w)``, passed by callers that cost many layouts of one workload.
    """
    pl = place(dims, topo)
    lk = lookups or Lookups.of(w)
    dense, dense_mem = dense_part(dims, pl, topo, w)
    sparse, sparse_mem = sparse_part(dims, pl, topo, w, lk, table_bytes_per_rank)
    memory = MemoryPerRank(**dense_mem, **sparse_mem)
    return StepCost(dims=dims, per_dim=(*dense, *sparse), memory=memory, placements=pl)


def dense_part(
    dims: ParallelDims, pl: dict[str, Placement], topo: Topology, w: Workload
) -> tuple[list[DimCost], dict[str, float]]:
    """The costs of ``tp``, ``cp``, ``dp_shard`` and ``dp_replicate``, and the dense part's memory."""
    samples = w.global_batch_size / dims.dp_degree  # per data-parallel rank (shared by its tp x cp ranks)
    tokens = samples * w.lengths.mean / dims.cp
    d, layers = w.embedding_dim, w.num_layers
    block_params = w.dense_params_per_layer / dims.tp
    params = layers * block_params + w.other_dense_params  # dense parameters of one rank before FSDP
    costs: list[DimCost] = []

    sent, t = ring(pl["tp"], topo, tokens * d * w.activation_bytes, allreduce=True)
    costs.append(DimCost("tp", dims.tp, pl["tp"].link, 2 * layers * sent, 2 * layers * t, 2 * layers * (dims.tp > 1),
                         "all-reduce of each block's output, forward and backward"))

    kv = tokens * dims.cp * (w.num_heads / dims.tp) * (w.attention_dim + w.value_dim) * w.activation_bytes
    sent, t = ring(pl["cp"], topo, kv)
    costs.append(DimCost("cp", dims.cp, pl["cp"].link, 2 * layers * sent, 2 * layers * t, 2 * layers * (dims.cp > 1),
                         "all-gather of K/V per block forward, reduce-scatter of dK/dV backward"))

    units = layers + (1 if w.other_dense_params else 0)  # FSDP units: the blocks, and the rest
    unit_params = params / units
    ag_sent, ag_t = ring(pl["dp_shard"], topo, unit_params * w.comm_param_bytes)
    rs_sent, rs_t = ring(pl["dp_shard"], topo, unit_params * w.grad_reduce_bytes)
    costs.append(DimCost("dp_shard", dims.dp_shard, pl["dp_shard"].link, units * (2 * ag_sent + rs_sent),
                         units * (2 * ag_t + rs_t), 3 * units * (dims.dp_shard > 1),
                         "FSDP2: all-gather forward and backward, reduce-scatter of gradients, per block"))

    rep = pl["dp_replicate"]
    sent, t = ring(rep, topo, unit_params / dims.dp_shard * w.grad_reduce_bytes, allreduce=True)
    costs.append(DimCost("dp_replicate", dims.dp_replicate, rep.link, units * sent, units * t, units * (rep.degree > 1),
                         "HSDP: all-reduce of the dense gradient shards across replicas, per block"))
    memory = {
        "dense_states": params / dims.dp_shard * (2 * w.param_bytes + w.optimizer_bytes_per_param),
        "dense_working": 2 * block_params * w.comm_param_bytes + (params * w.grad_reduce_bytes if dims.dp_shard == 1 else 0),
        "activations": tokens * layers * w.saved_activations_per_token_per_layer * d * w.activation_bytes / dims.tp,
    }
    return costs, memory


def sparse_part(
    dims: ParallelDims,
    pl: dict[str, Placement],
    topo: Topology,
    w: Workload,
    lk: Lookups,
    table_bytes_per_rank: float | None = None,
) -> tuple[list[DimCost], dict[str, float]]:
    """The costs of ``sparse`` and of its replicas' sync, and the tables' memory. Depends on the dense
    dims only through the data-parallel degree and ``cp``, and on the order only through the cut."""
    samples = w.global_batch_size / dims.dp_degree
    tables = table_bytes_per_rank if table_bytes_per_rank is not None else w.total_table_bytes / dims.sparse
    costs = [_sparse_cost(dims, pl, topo, w, samples, lk), _replica_sync_cost(dims, pl, topo, w, tables)]
    emb_elems = samples * (lk.seq_elems / dims.cp + lk.pooled_elems)
    return costs, {"tables": tables, "embedding_buffers": 2 * emb_elems * w.table_bytes}


def _sparse_cost(dims: ParallelDims, pl: dict[str, Placement], topo: Topology, w: Workload, samples: float,
                 lk: Lookups) -> DimCost:
    p = pl["sparse"]
    # a cp rank looks up the ids of its part of each sequence; pooled features once per sample
    ids = samples * (lk.seq_ids / dims.cp + lk.pooled_ids)
    out_elems = samples * (lk.seq_elems / dims.cp + lk.pooled_elems)
    sent_ids, t_ids = all_to_all(p, topo, ids * w.ids_bytes)
    sent_out, t_out = all_to_all(p, topo, out_elems * w.table_bytes)
    return DimCost("sparse", dims.sparse, p.link, sent_ids + 2 * sent_out, t_ids + 2 * t_out, 3 * int(p.degree > 1),
                   "all-to-all of ids, of embeddings forward and of their gradients backward (each looked-up "
                   "embedding crosses once, as for table-wise and row-wise sequence tables)")


def _replica_sync_cost(dims: ParallelDims, pl: dict[str, Placement], topo: Topology, w: Workload,
                       table_bytes: float) -> DimCost:
    r = dims.sparse_replicas
    # the ranks holding the same shard: ``sparse`` apart for contiguous groups, neighbours for strided ones
    stride = dims.sparse if pl["sparse"].stride == 1 else 1
    g = topo.gpus_per_node
    per_node = 1 if stride >= g else min(r, g // stride)
    group = Placement(dim="sparse", degree=r, stride=stride, members_per_node=per_node)
    sent, t = ring(group, topo, table_bytes, allreduce=True)
    every = w.table_sync_every
    return DimCost("sparse_replicas", r, group.link, sent / every, t / every, int(r > 1),
                   f"all-reduce of each rank's table shard across the {r} sparse groups, every {every} steps")
