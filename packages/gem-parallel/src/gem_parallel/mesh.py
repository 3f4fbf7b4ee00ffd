"""From the degrees of :class:`~gem_parallel.dims.ParallelDims` to the run's :class:`~gem_model.layout.Layout`.

``ParallelDims`` is the planning form of a layout (it knows ``sparse``, which divides the world,
and checks the degrees against the model before any process starts); ``Layout`` is the run's form
(the mesh, this rank's coordinates, each dim's group). :func:`build_layout` makes the second from
the first: ``init_device_mesh`` over the enabled dense dims, named as TorchTitan names them, in the
order of a :class:`~gem_parallel.dims.MeshOrder`, plus the flattened groups the loop reduces over
(the data dims for gradients of replicated tables, the data x context dims for the loss).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from gem_model.distributed import DistEnv
from gem_model.layout import DATA_DIMS, LOSS_DIMS, Layout
from gem_parallel.dims import MeshOrder, ParallelDims

SHARD_DIMS = ("dp_shard", "cp")
DEFAULT_ORDER = MeshOrder()
"""TorchTitan's order, outermost first: ``dp_replicate, dp_shard, cp, tp`` (tp innermost: NVLink)."""


def mesh_dims(dims: ParallelDims, order: MeshOrder = DEFAULT_ORDER) -> dict[str, int]:
    """The mesh's dims and degrees, outermost first: the enabled dense dims, and ``dp_shard`` also
    at degree 1 beside ``dp_replicate`` (FSDP2 replicates only over the first dim of a 2-D mesh) or
    alone for one rank."""
    live = {d: dims.degree(d) for d in order.outer_to_inner if dims.degree(d) > 1 or (d == "dp_shard" and dims.dp_replicate > 1)}
    return live or {"dp_shard": 1}


def build_layout(dims: ParallelDims, env: DistEnv, order: MeshOrder = DEFAULT_ORDER) -> Layout:
    """The layout of ``dims`` for this rank: with a ``DeviceMesh`` and its groups when ``env`` has a
    process group, degrees and coordinates only when it has none (``gem-train plan``, pre-launch checks)."""
    degrees = mesh_dims(dims, order)
    coords = {d: c for d, c in order.coordinates(env.rank, dims).items() if d in degrees}
    if not (env.distributed and dist.is_initialized()):
        return Layout(degrees, coords)
    mesh = init_device_mesh(env.device.type, tuple(degrees.values()), mesh_dim_names=tuple(degrees))
    actual = dict(zip(degrees, mesh.get_coordinate() or (), strict=True))
    if actual != coords:  # the mesh is row-major over its dims, as MeshOrder.coordinates
        raise RuntimeError(f"rank {env.rank}: the device mesh puts it at {actual}, the layout at {coords}")
    groups = {d: mesh.get_group(d) for d in degrees}
    for flat in _flat_groups(degrees):
        groups["+".join(flat)] = mesh[flat]._flatten("+".join(flat)).get_group()
    return Layout(degrees, coords, groups, mesh)


def fsdp_mesh(layout: Layout) -> DeviceMesh | None:
    """The mesh FSDP2 shards the dense part over: ``dp_shard x cp`` (flattened; a cp rank holds other
    rows of the same samples, so its gradients average with the data shards'), 2-D with
    ``dp_replicate`` in front for HSDP; None when the layout has no data or context dim."""
    live = [d for d in SHARD_DIMS if layout.enabled(d)]
    shard = "+".join(live) if live else "dp_shard" if "dp_shard" in layout.degrees else ""
    if not shard:
        return layout.mesh["dp_replicate"] if "dp_replicate" in layout.degrees else None
    return layout.mesh[("dp_replicate", shard)] if "dp_replicate" in layout.degrees else layout.mesh[shard]


def _flat_groups(degrees: dict[str, int]) -> list[tuple[str, ...]]:
    """The live dims (degree > 1, in mesh order) of each flattened group over more than one that
    :class:`Layout` is asked for (its key joins them with ``+``), or FSDP2 shards over: the data
    dims, the data x context dims, and ``dp_shard x cp``."""
    out: list[tuple[str, ...]] = []
    for dims in (SHARD_DIMS, DATA_DIMS, LOSS_DIMS):
        live = tuple(d for d in degrees if d in dims and degrees[d] > 1)
        if len(live) > 1 and live not in out:
            out.append(live)
    return out
