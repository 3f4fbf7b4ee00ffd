"""``hierarchical``: dense gradients reduced inside a node first, then across nodes.

A DDP comm hook: every bucket (divided by the world size, as DDP does) is

1. reduce-scattered over the ranks of this node (``L`` ranks: each keeps ``1/L`` of the bucket);
2. all-reduced, that ``1/L`` only, over the ranks with the same local index on the other nodes;
3. all-gathered over the node again.

Only ``1/L`` of the bytes cross the slow inter-node link. Nodes are blocks of ``node_size``
consecutive ranks of the DDP group (``node_size`` from the option, else ``LOCAL_WORLD_SIZE`` as
torchrun sets it), so 4 ranks can be treated as 2 nodes of 2 on one machine. The sums run in
another order than one flat all-reduce, so results equal ``default``'s up to float32 rounding
(bit for bit where the sums are exact).
"""

# no ``from __future__ import annotations``: DDP checks a comm hook's annotations as objects
import datetime
import os
from typing import ClassVar

import torch
import torch.distributed as dist
from pydantic import Field
from torch.nn.parallel import DistributedDataParallel

from gem_comm._base import MeasuredComm, done, flat_padded
from gem_comm.measure import CommMeter, all_gather_bytes, ring_all_reduce_bytes, scatter_bytes
from gem_model.api import ComponentConfig


class HierarchicalConfig(ComponentConfig):
    node_size: int | None = Field(
        None, gt=0, description="ranks per node; None: the LOCAL_WORLD_SIZE environment variable (torchrun sets it)"
    )


class NodeGroups:
    """The intra-node group of this rank and its inter-node group (same local index on every node)."""

    def __init__(self, ranks: list[int], node_size: int, rank: int, timeout: datetime.timedelta):
        if len(ranks) % node_size:
            raise ValueError(
                f"comm.strategy 'hierarchical': the DDP group's {len(ranks)} ranks do not split into nodes of "
                f"node_size={node_size} (comm.strategy.options.node_size or LOCAL_WORLD_SIZE)"
            )
        nodes = [ranks[i : i + node_size] for i in range(0, len(ranks), node_size)]
        across = [list(r) for r in zip(*nodes, strict=True)]
        # new_group is collective over the default group: every rank makes every group, in this order;
        # each with the run's collective timeout (a group made without one waits for gloo's 30 minutes)
        self.intra = self.inter = None
        for members in nodes:
            group = dist.new_group(members, timeout=timeout)
            if rank in members:
                self.intra = group
        for members in across:
            group = dist.new_group(members, timeout=timeout)
            if rank in members:
                self.inter = group
        self.node_size, self.nodes = node_size, len(nodes)


class _HookState:
    def __init__(self, groups: NodeGroups, world: int, meter: CommMeter):
        self.groups, self.world, self.meter = groups, world, meter


def hierarchical_hook(state: _HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce-scatter in the node, all-reduce across nodes, all-gather in the node: the bucket's mean."""
    groups, local = state.groups, state.groups.node_size
    buffer = bucket.buffer()
    full = flat_padded(buffer.div(state.world), local, buffer.dtype)
    part = torch.empty(full.numel() // local, dtype=full.dtype, device=full.device)
    nbytes = full.numel() * full.element_size()
    if local > 1:
        with state.meter.timed("dense.reduce_scatter.intra", scatter_bytes(nbytes, local)):
            dist.reduce_scatter_tensor(part, full, group=groups.intra)
    else:
        part.copy_(full)
    if groups.nodes > 1:
        with state.meter.timed("dense.all_reduce.inter", ring_all_reduce_bytes(part.numel() * part.element_size(), groups.nodes)):
            dist.all_reduce(part, group=groups.inter)
    if local > 1:
        with state.meter.timed("dense.all_gather.intra", all_gather_bytes(part.numel() * part.element_size(), local)):
            dist.all_gather_into_tensor(full, part, group=groups.intra)
    else:
        full.copy_(part)
    buffer.copy_(full[: buffer.numel()])
    return done(buffer)


class HierarchicalComm(MeasuredComm):
    name: ClassVar[str] = "hierarchical"
    Config = HierarchicalConfig
    config: HierarchicalConfig

    def node_size(self) -> int:
        if self.config.node_size is not None:
            return self.config.node_size
        value = os.environ.get("LOCAL_WORLD_SIZE")
        if value is None or not value.isdigit() or int(value) < 1:
            raise ValueError(
                "comm.strategy 'hierarchical': no node size; set comm.strategy.options.node_size or launch with "
                f"torchrun (LOCAL_WORLD_SIZE={value!r})"
            )
        return int(value)

    def configure_ddp(self, ddp: DistributedDataParallel) -> None:
        group = self._ddp_group(ddp)
        ranks = dist.get_process_group_ranks(group)
        self.groups = NodeGroups(ranks, self.node_size(), dist.get_rank(), self.env.timeout)
        ddp.register_comm_hook(_HookState(self.groups, len(ranks), self.meter), hierarchical_hook)
