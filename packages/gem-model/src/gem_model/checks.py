"""Constraints across config fields and against the data, checked before any process starts.

Field-by-field checks are the pydantic models' (:mod:`gem_model.config`); these need the resolved
components (the data source's feature spec, the planner's degrees: :mod:`gem_model.parallel_checks`)
and the number of processes.
Every problem is reported together, each with its dotted config path and the bad value.
"""

from __future__ import annotations

from gem_model.config import RunConfig
from gem_model.errors import ConfigError
from gem_model.parallel_checks import parallel_problems
from gem_model.resolve import Components


def run_problems(
    config: RunConfig, components: Components, world_size: int, *, ranks_per_node: int | None = None
) -> list[tuple[str, object, str]]:
    mc, problems = config.model, []
    mixers = mc.cross_layers + (mc.interaction_layers if mc.use_side_features else 0)
    if mixers and mc.embedding_dim % mc.num_heads:
        problems.append(
            ("model.num_heads", mc.num_heads, f"must divide model.embedding_dim ({mc.embedding_dim}): the "
             "interaction and cross layers split the width over the heads")
        )  # fmt: skip
    problems += parallel_problems(config, components, world_size, ranks_per_node=ranks_per_node)
    history = components.source.feature_spec().max_history
    need = history + int(mc.use_candidate) + int(mc.context_token)
    if mc.max_seq_len < need:
        problems.append(
            ("model.max_seq_len", mc.max_seq_len, f"is shorter than the data's longest history ({history}, "
             f"data.source {config.data.source.name!r}) plus the candidate ({int(mc.use_candidate)}) plus the "
             f"context token ({int(mc.context_token)}): it must be at least {need}")
        )  # fmt: skip
    return problems


def check_run(config: RunConfig, components: Components, world_size: int, *, ranks_per_node: int | None = None) -> None:
    """Raise one :class:`ConfigError` listing every cross-field and data constraint ``config`` breaks."""
    problems = run_problems(config, components, world_size, ranks_per_node=ranks_per_node)
    if problems:
        raise ConfigError(problems)
