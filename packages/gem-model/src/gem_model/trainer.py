"""The entry point of a training run: parse-free, so tests and the CLI share it."""

from __future__ import annotations

import os

from gem_model.checks import check_run
from gem_model.config import RunConfig
from gem_model.distributed import init_distributed, launched_by_torchrun, teardown
from gem_model.errors import RunInterrupted
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components
from gem_model.results import RunSummary
from gem_model.train.outputs import check_output_dir
from gem_model.train.run import Run


def train(config: RunConfig, pm: GemPluginManager | None = None) -> RunSummary:
    """Resolve every component (before any process group), join the group, train, leave cleanly."""
    pm = pm if pm is not None else GemPluginManager()
    components = resolve_components(config, pm)
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    check_run(config, components, world)
    check_output_dir(config, world)
    env = init_distributed(config.trainer.device, timeout_s=config.trainer.collective_timeout_s)
    clean = False
    try:
        summary = Run(config, pm, components, env).fit()
        clean = True
        return summary
    except RunInterrupted:
        clean = True  # every rank stopped after the same step and wrote the checkpoint together
        raise
    finally:
        teardown(env, clean=clean)
