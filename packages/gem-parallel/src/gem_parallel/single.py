"""``single``: one process, one device, no wrapping.

The tables stay plain torchrec modules and get a row-wise Adagrad that steps after backward (the
same update rule the fused torchrec kernel applies inside backward in sharded runs).
"""

from __future__ import annotations

from typing import ClassVar

from torchrec.optim.keyed import KeyedOptimizerWrapper

from gem_model.components import CommStrategy, ParallelPlanner, PreparedModel, SparseOptimizerSpec
from gem_model.distributed import DistEnv
from gem_model.model.gem import GemModel


class SinglePlanner(ParallelPlanner):
    name: ClassVar[str] = "single"
    max_world_size: ClassVar[int | None] = 1

    def prepare(
        self, model: GemModel, *, env: DistEnv, comm: CommStrategy, sparse_optimizer: SparseOptimizerSpec
    ) -> PreparedModel:
        if env.world_size != 1:
            raise ValueError(
                f"parallel.planner 'single' runs one process, but this run has {env.world_size}; "
                "use parallel.planner=torchrec_ddp"
            )
        if model.sparse.on_meta:  # model.table_init: device
            model.sparse.materialize_on(env.device, model.seed)
        model.to(env.device)
        tables = {f"sparse.{n}": p for n, p in model.sparse.named_parameters()}
        dense = [(n, p) for n, p in model.named_parameters() if not n.startswith("sparse.")]
        optimizer = KeyedOptimizerWrapper(tables, lambda params: sparse_optimizer.cls(params, **sparse_optimizer.kwargs))
        summary = f"single process on {env.device}: {len(tables)} tables unsharded, {len(dense)} dense tensors"
        return PreparedModel(
            module=model,
            dense_parameters=dense,
            sparse_optimizer=optimizer,
            sparse_optimizer_fused=False,
            plan_summary=summary,
        )
