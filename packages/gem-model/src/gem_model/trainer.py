"""The entry point of a training run: parse-free, so tests and the CLI share it."""

from __future__ import annotations

from gem_model.config import RunConfig
from gem_model.distributed import init_distributed, teardown
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components
from gem_model.results import RunSummary
from gem_model.train.run import Run


def train(config: RunConfig, pm: GemPluginManager | None = None) -> RunSummary:
    """Resolve every component (before any process group), join the group, train, leave cleanly."""
    pm = pm if pm is not None else GemPluginManager()
    components = resolve_components(config, pm)
    env = init_distributed(config.trainer.device)
    clean = False
    try:
        summary = Run(config, pm, components, env).fit()
        clean = True
        return summary
    finally:
        teardown(env, clean=clean)
