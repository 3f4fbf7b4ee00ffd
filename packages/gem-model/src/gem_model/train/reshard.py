"""Loading a checkpoint at another world size: what reshards, and what cannot.

DCP reshards what it saved as global tensors: the dense parameters and their optimizer state
(replicated, or DTensors under FSDP) and torchrec's sharded tables with their fused optimizer
state (ShardedTensors: each rank reads the rows its new shards hold, whatever the old placement).
The data position is global. What cannot reshard is refused before any tensor loads, naming it and
both world sizes: a change of any layout degree other than the data-parallel ones (``pp``, ``cp``,
``tp``, ``ep`` partition the model itself). Each rank's RNG state belongs to a rank of the old
world: a resharded run starts every rank's RNG afresh from its seed, and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gem_model.errors import CheckpointError
from gem_model.layout import DATA_DIMS, Layout


def check(path: Path, meta: dict[str, Any], layout: Layout) -> None:
    """Refuse ``path`` when a non-data-parallel degree of its layout differs from ``layout``'s."""
    saved_world = int(meta.get("world_size", layout.world_size))
    saved = {d: int(n) for d, n in meta.get("layout", {}).get("degrees", {}).items()}
    here = dict(layout.degrees)
    fixed = sorted((set(saved) | set(here)) - set(DATA_DIMS))
    differ = [f"{d} ({saved.get(d, 1)} -> {here.get(d, 1)})" for d in fixed if saved.get(d, 1) != here.get(d, 1)]
    if differ:
        raise CheckpointError(
            f"{path} was written by {saved_world} processes (layout {saved}) and cannot be resharded to this run's "
            f"{layout.world_size} (layout {here}): the degree(s) {', '.join(differ)} partition the model itself; only "
            f"the data-parallel degrees ({', '.join(DATA_DIMS)}) reshard. Resume it at a layout with the same "
            "degrees for those dims"
        )


def rank_keys(state: dict[str, Any]) -> set[str]:
    """The dotted keys of per-rank state (each rank's RNG) that a resharded load leaves fresh."""
    return {f"{k}.{sub}" for k, v in state.items() if k.startswith("rng_rank") for sub in v}
