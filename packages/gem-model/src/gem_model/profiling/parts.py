"""A profile's :class:`~gem_model.profiling.context.ProfileContext`, and the parts of the run that
several sections read, each built once: the planner's offline plan, a data-parallel rank's first
batch, and a model for the dense parameters' sizes (its tables on the meta device).

:func:`profile_context` is what a ``gem-train profile`` subcommand of a plugin calls to get the same
context the full report's sections get (its model, its memory checks) without running a profile.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from gem_model.config import PrecisionConfig, RunConfig
from gem_model.data.batch import Batch
from gem_model.data.loader import ShardedLoader
from gem_model.distributed import launched_by_torchrun, pick_device
from gem_model.model.gem import GemModel
from gem_model.plan import Plan
from gem_model.profiling.context import MeasuredSteps, ProfileContext
from gem_model.profiling.memory import MemoryFit, precision_memory
from gem_model.profiling.shared_model import initial_model
from gem_model.resolve import Components, resolve_components, run_shape
from gem_model.train.prepare import offline_plan


class RunParts:
    """What the sections share of the run (module doc); each part is built on first use."""

    def __init__(self, ctx: ProfileContext, components: Components):
        self.ctx, self.components = ctx, components

    @functools.cached_property
    def plan(self) -> Plan:
        return offline_plan(self.ctx.config, self.components, world_size=self.ctx.world_size)

    @functools.cached_property
    def first_batch(self) -> Batch:
        config, c = self.ctx.config, self.components
        loader = ShardedLoader(c.source, c.balancer, global_batch_size=config.data.global_batch_size,
                               world_size=self.ctx.dp_degree)  # fmt: skip
        return loader.batch_at(0).to(self.ctx.device)

    @functools.cached_property
    def sizes(self) -> GemModel:
        config, c = self.ctx.config, self.components
        return GemModel(config.model.model_copy(update={"table_init": "device", "embedding_init_std": None}),
                        c.source.feature_spec(), attention=c.attention, norm_gate=c.norm_gate,
                        next_item_loss=c.next_item_loss, sequence_pool=c.sequence_pool,
                        sequence_input=c.sequence_input)  # fmt: skip

    def memory_fit(self, precision: PrecisionConfig) -> MemoryFit:
        return precision_memory(self.ctx, self.components, self.plan, self.first_batch, self.sizes, precision)


def make_context(
    config: RunConfig,
    pm: Any,
    components: Components,
    *,
    world: int,
    batches: int,
    out: Path,
    measured: MeasuredSteps | None = None,
    selected: frozenset[str] | None = None,
) -> tuple[ProfileContext, RunParts]:
    device = pick_device(config.trainer.device, int(os.environ.get("LOCAL_RANK", "0")))
    components.planner.bind_run(run_shape(config, components))
    ctx = ProfileContext(config, pm, device, world, components.planner.dims(world).dp_degree, batches, out, measured,
                         selected=selected, build_model=functools.partial(initial_model, config, pm, device))  # fmt: skip
    parts = RunParts(ctx, components)
    ctx.fit_memory = parts.memory_fit
    return ctx, parts


def profile_context(config: RunConfig, pm: Any, *, world: int | None = None) -> ProfileContext:
    """The context of a profile of ``config`` in this process: ``world`` processes assumed (default:
    the launched world), no measured steps, no sections made yet; its model is built on first use."""
    launched = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    ctx, _ = make_context(config, pm, resolve_components(config, pm), world=world or launched, batches=1, out=Path("."))
    return ctx
