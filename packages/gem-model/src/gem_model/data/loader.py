"""The rank-sharded loader: global batch lengths -> balancer -> this rank's samples."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from gem_model.components import DataSource, LoadBalancer
from gem_model.data.batch import Batch
from gem_model.data.validation import validate_batch


class ShardedLoader:
    """Yields this rank's batch of each step; its position can be saved and restored."""

    def __init__(
        self,
        source: DataSource,
        balancer: LoadBalancer,
        *,
        global_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        validate: bool = True,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, {world_size})")
        self.source = source
        self.balancer = balancer
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.validate = validate
        self.spec = source.feature_spec()
        self.step = 0

    def batch_at(self, step: int) -> Batch:
        lengths = self.source.lengths(step, self.global_batch_size)
        assignment = self.balancer.assign(lengths, self.world_size)
        sizes = {int(a.numel()) for a in assignment}
        if len(assignment) != self.world_size or len(sizes) != 1:
            raise ValueError(
                f"load balancer {self.balancer.name!r} returned {len(assignment)} shards of sizes "
                f"{sorted(sizes)}; expected {self.world_size} shards of equal size"
            )
        batch = self.source.make_batch(step, self.global_batch_size, assignment[self.rank])
        if self.validate:
            validate_batch(batch, self.spec)
        return batch

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if int(state["global_batch_size"]) != self.global_batch_size:
            raise ValueError(
                f"the checkpoint's loader used global_batch_size {state['global_batch_size']}, "
                f"this run uses {self.global_batch_size}"
            )
        self.step = int(state["step"])

    def epoch_of(self, step: int) -> float | None:
        per_epoch = self.source.steps_per_epoch(self.global_batch_size)
        return None if per_epoch is None else step / per_epoch


def local_tokens(batch: Batch) -> int:
    return int(batch.history_lengths().sum())


__all__ = ["ShardedLoader", "local_tokens"]
