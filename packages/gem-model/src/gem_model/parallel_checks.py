"""Every constraint on the parallel degrees, checked before any process starts.

The planner says the degrees (:meth:`ParallelPlanner.dims <gem_model.components.ParallelPlanner.dims>`,
which refuses options that cannot fit the world size); :meth:`ParallelDims.problems
<gem_model.parallel_dims.ParallelDims.problems>` checks them against the run (the world, the heads,
the lengths, the batch); and here, what tensor parallelism needs of the precision config: DTensor
splits ``nn.Linear`` modules only, so the blocks' ``uvqk`` and ``out`` must stay linears under the
run's scheme. Each problem names the planner's option (``parallel.planner.options.tp``) and the
field it must fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gem_model.errors import ConfigError
from gem_model.parallel_dims import Problem
from gem_model.resolve import run_shape

if TYPE_CHECKING:
    from gem_model.config import RunConfig
    from gem_model.resolve import Components

TP_LINEARS = ("uvqk", "out")
"""The linears of an HSTU block that tensor parallelism splits (``gem_parallel.tensor_parallel``)."""


def parallel_problems(
    config: RunConfig, components: Components, world_size: int, *, ranks_per_node: int | None = None
) -> list[Problem]:
    """The problems of the degrees the run's planner chooses for ``world_size`` processes."""
    planner = components.planner
    planner.bind_run(run_shape(config, components, ranks_per_node=ranks_per_node))
    try:
        dims = planner.dims(world_size)
    except ConfigError as exc:
        return list(exc.problems)
    except (ValueError, TypeError) as exc:
        return [("parallel.planner", config.parallel.planner.name, f"cannot lay out {world_size} processes: {exc}")]
    mc = config.model
    problems = dims.problems(
        world_size=world_size, num_heads=mc.num_heads, global_batch_size=config.data.global_batch_size,
        max_seq_len=mc.max_seq_len, where=planner.dims_path,
    )  # fmt: skip
    if dims.tp > 1:
        problems += tp_precision_problems(config, components, dims.tp, where=f"{planner.dims_path}.tp")
    return problems


def tp_precision_problems(config: RunConfig, components: Components, tp: int, *, where: str) -> list[Problem]:
    """A block linear that tensor parallelism splits but the precision config converts into
    something other than an ``nn.Linear``: asked of the scheme itself, on a meta-device linear of
    the block's shape (no memory, no weights)."""
    import torch
    from torch import nn

    from gem_model.precision import precision_plan

    mc = config.model
    width = mc.num_heads * (2 * mc.value_dim + 2 * mc.attention_dim)
    shapes = {"uvqk": (mc.embedding_dim, width), "out": (mc.num_heads * mc.value_dim, mc.embedding_dim)}
    blocks = nn.Module()
    with torch.device("meta"):
        for i in range(mc.num_blocks):
            block = nn.Module()
            for part in TP_LINEARS:
                setattr(block, part, nn.Linear(*shapes[part]))
            blocks.add_module(str(i), block)
        root = nn.Module()
        root.add_module("blocks", blocks)
        plan = precision_plan(root, config.precision)
        converted: list[str] = []
        refused: list[Problem] = []
        for fqn, scheme in plan.items():
            if scheme is None:
                continue
            try:
                kept = components.precision[scheme].convert_linear(root.get_submodule(fqn), fqn)
            except (ValueError, RuntimeError) as exc:  # e.g. a shape its GEMM cannot take
                refused.append(("precision.scheme", scheme, f"cannot convert {fqn}: {exc}"))
                continue
            if not isinstance(kept, nn.Linear):
                converted.append(f"{fqn} ({scheme}: {type(kept).__name__})")
    if not converted:
        return refused
    return [*refused, (
        where, tp,
        f"tensor parallelism splits the HSTU blocks' uvqk and out, and DTensor splits nn.Linear only, but the precision "
        f"config converts {', '.join(converted[:4])}{' and more' if len(converted) > 4 else ''}; keep them in float32 "
        "(precision.exclude: ['blocks.*.uvqk', 'blocks.*.out']) or run without tp",
    )]  # fmt: skip
