"""A cluster as the planner sees it, and which links each dimension's groups use.

Bandwidths are per GPU and one direction, in bytes per second; latencies are per message, in
seconds. ``h200`` gives an H200 HGX node: NVLink 4 (450 GB/s per direction), one 400 Gb/s NIC per
GPU (50 GB/s), 141 GB of HBM. The ``auto`` planner takes them as options (:mod:`gem_parallel.auto`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from gem_model.api import MESH_DIMS, ParallelDims

DIM_NAMES: tuple[str, ...] = (*MESH_DIMS, "sparse")
LinkKind = Literal["none", "nvlink", "network", "mixed"]


class Topology(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    nodes: int = Field(ge=1)
    gpus_per_node: int = Field(ge=1)
    intra_node_bw: float = Field(gt=0, description="NVLink bytes/s per GPU, one direction")
    intra_node_latency: float = Field(ge=0, description="seconds per message inside a node")
    inter_node_bw: float = Field(gt=0, description="network bytes/s per GPU, one direction")
    inter_node_latency: float = Field(ge=0, description="seconds per message between nodes")
    hbm_bytes: int = Field(gt=0, description="memory per GPU")
    hbm_reserved_fraction: float = Field(
        0.1, ge=0, lt=1, description="kept free of the plan (allocator fragmentation, NCCL and CUDA context)"
    )

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_hbm(self) -> float:
        return self.hbm_bytes * (1.0 - self.hbm_reserved_fraction)

    def describe(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node}"


def h200(nodes: int, gpus_per_node: int = 8) -> Topology:
    """H200 HGX nodes on a 400 Gb/s-per-GPU fabric."""
    return Topology(
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        intra_node_bw=450e9,
        intra_node_latency=3e-6,
        inter_node_bw=50e9,
        inter_node_latency=10e-6,
        hbm_bytes=141 * 10**9,
    )


@dataclass(frozen=True)
class Placement:
    """Where the groups of one dimension lie.

    ``members_per_node`` of the ``degree`` members of a group share a node; the others are reached
    over the network.
    """

    dim: str
    degree: int
    stride: int
    members_per_node: int

    @property
    def link(self) -> LinkKind:
        if self.degree == 1:
            return "none"
        if self.members_per_node >= self.degree:
            return "nvlink"
        return "network" if self.members_per_node == 1 else "mixed"

    @property
    def nodes_spanned(self) -> int:
        return -(-self.degree // self.members_per_node)


def place(dims: ParallelDims, topology: Topology) -> dict[str, Placement]:
    """The placement of every dimension when the mesh is laid over the global ranks in the dims'
    mesh order (and their sparse groups cut as they say).

    Global rank ``r`` sits on node ``r // gpus_per_node`` (torchrun's rank order).
    """
    if dims.world_size != topology.world_size:
        raise ValueError(
            f"the degrees ({dims}) make {dims.world_size} ranks, the topology "
            f"{topology.describe()} has {topology.world_size}"
        )
    strides = dims.strides()
    g = topology.gpus_per_node
    out: dict[str, Placement] = {}
    for name in DIM_NAMES:
        n, s = dims.degree(name), strides[name]
        # members r, r+s, ..., r+(n-1)s: those within one node of g GPUs
        per_node = 1 if s >= g else min(n, max(1, g // s))
        out[name] = Placement(dim=name, degree=n, stride=s, members_per_node=per_node)
    return out
