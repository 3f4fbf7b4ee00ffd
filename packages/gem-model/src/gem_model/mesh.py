"""The device mesh and process groups of a :class:`~gem_model.layout.Layout` (collective: every rank calls it).

``init_device_mesh`` over the layout's mesh dims, named as TorchTitan names them, in the dims' mesh
order; then the flattened groups the loop and FSDP2 reduce over (``dp_shard x cp`` for FSDP2, the
data dims for the gradients of replicated tables, the data x context dims for the loss); then, when
the sparse groups are smaller than the world, those groups (torchrec's 2-D
sparse parallelism: a ``world / sparse x sparse`` mesh, its rows or its columns the sharding
groups as the dims cut them, contiguous or strided). Every group gets the run's collective timeout
(:func:`~gem_model.distributed.group_timeout`), which ``init_device_mesh`` does not pass on.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gem_model.distributed import group_timeout
from gem_model.parallel_dims import DATA_DIMS, LOSS_DIMS, SPARSE_GROUP, SPARSE_REPLICA_GROUP, ParallelDims


class MeshSpec(Protocol):
    """What the mesh is built from: a :class:`~gem_model.layout.Layout` (which builds its mesh here,
    so this module names only the fields it reads)."""

    dims: ParallelDims
    rank: int

    @property
    def degrees(self) -> dict[str, int]: ...

    @property
    def coords(self) -> dict[str, int]: ...

    @property
    def world_size(self) -> int: ...

FLAT_GROUPS = (("dp_shard", "cp"), DATA_DIMS, LOSS_DIMS)


def build_groups(layout: MeshSpec, device_type: str, *, timeout_s: float | None = None) -> tuple[DeviceMesh, dict[str, Any]]:
    """(the mesh, every group by its key in :attr:`Layout.groups`) for this rank of ``layout``; each
    group with the collective timeout ``timeout_s`` (None: as ``torch.distributed`` made it)."""
    if not dist.is_initialized():
        raise RuntimeError("a device mesh needs the process group: torch.distributed is not initialized")
    degrees = layout.degrees
    mesh = init_device_mesh(device_type, tuple(degrees.values()), mesh_dim_names=tuple(degrees))
    actual = dict(zip(degrees, mesh.get_coordinate() or (), strict=True))
    if actual != layout.coords:  # the mesh is row-major over its dims, as ParallelDims.coordinates
        raise RuntimeError(f"rank {layout.rank}: the device mesh puts it at {actual}, the layout at {layout.coords}")
    groups: dict[str, Any] = {d: mesh.get_group(d) for d in degrees}
    for dims in FLAT_GROUPS:
        live = tuple(d for d in degrees if d in dims and degrees[d] > 1)
        key = "+".join(live)
        if len(live) > 1 and key not in groups:
            groups[key] = mesh[live]._flatten(key).get_group()
    sparse, world = layout.dims.sparse, layout.world_size
    if sparse < world:  # a sparse group of 1 too: a planner may shard its tables over one rank
        groups.update(_sparse_groups(world, sparse, strided=layout.dims.sparse_groups == "strided", device_type=device_type))
    if timeout_s is not None:
        for group in groups.values():
            group_timeout(group, timeout_s)
    return mesh, groups


def _sparse_groups(world: int, sparse: int, *, strided: bool, device_type: str) -> dict[str, Any]:
    """This rank's sharding group of ``sparse`` ranks and its replica group, from a 2-D mesh: rows of
    ``world / sparse x sparse`` (contiguous groups), or columns of ``sparse x world / sparse`` (strided)."""
    replicas = world // sparse
    if strided:
        mesh = init_device_mesh(device_type, (sparse, replicas), mesh_dim_names=(SPARSE_GROUP, SPARSE_REPLICA_GROUP))
    else:
        mesh = init_device_mesh(device_type, (replicas, sparse), mesh_dim_names=(SPARSE_REPLICA_GROUP, SPARSE_GROUP))
    return {SPARSE_GROUP: mesh.get_group(SPARSE_GROUP), SPARSE_REPLICA_GROUP: mesh.get_group(SPARSE_REPLICA_GROUP)}
