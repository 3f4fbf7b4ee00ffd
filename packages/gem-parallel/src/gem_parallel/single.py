"""``single``: one process, one device, no wrapping.

The tables stay plain torchrec modules and get a row-wise Adagrad that steps after backward (the
same update rule the fused torchrec kernel applies inside backward in sharded runs).
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn
from torchrec.optim.keyed import KeyedOptimizerWrapper

from gem_model.api import (
    DensePlacement,
    ParallelDims,
    ParallelPlanner,
    Plan,
    PlannerContext,
    PreparedModel,
    ShardableModel,
    TablePlacement,
)


def dense_modules(model: ShardableModel) -> dict[str, int]:
    """Top-level dense module name -> its parameter count (the rows of a plan's dense part)."""
    out: dict[str, int] = {}
    for name, p in model.dense_named_parameters():
        top = name.split(".")[0]
        out[top] = out.get(top, 0) + p.numel()
    return out


class SinglePlanner(ParallelPlanner):
    name: ClassVar[str] = "single"
    max_world_size: ClassVar[int | None] = 1

    def dims(self, world_size: int) -> ParallelDims:
        if world_size != 1:
            raise ValueError(
                f"parallel.planner 'single' runs one process, but this run has {world_size}; "
                "use parallel.planner=torchrec_ddp"
            )
        return ParallelDims(dp_shard=1, sparse=1)

    def plan(self, model: ShardableModel, ctx: PlannerContext) -> Plan:
        tables = {
            c.name: TablePlacement("unsharded", [0], rows=c.num_embeddings, dim=c.embedding_dim)
            for c in model.table_configs()
        }
        dense = {name: DensePlacement("local", parameters=n) for name, n in dense_modules(model).items()}
        return Plan(self.name, ctx.layout.describe(), tables, dense)

    def apply(self, model: ShardableModel, plan: Plan, ctx: PlannerContext) -> PreparedModel:
        env, spec = ctx.env, ctx.sparse_optimizer
        if model.tables_on_meta:  # model.table_init: device
            model.materialize_tables(env.device)
        model.to(env.device)  # type: ignore[attr-defined]
        tables = table_parameters(model)
        dense = model.dense_named_parameters()
        optimizer = KeyedOptimizerWrapper(tables, lambda params: spec.cls(params, **spec.kwargs))
        summary = f"single process on {env.device}: {len(tables)} tables unsharded, {len(dense)} dense tensors"
        return PreparedModel(
            module=model,  # type: ignore[arg-type]
            dense_parameters=dense,
            sparse_optimizer=optimizer,
            sparse_optimizer_fused=False,
            plan_summary=summary,
        )


def table_parameters(model: ShardableModel) -> dict[str, nn.Parameter]:
    """Every parameter of the (unsharded) tables, by its name in the model."""
    return {
        f"{module_name}.{n}": p for module_name, module in model.table_modules().items() for n, p in module.named_parameters()
    }
