"""The model the profile's sections share (:meth:`ProfileContext.model
<gem_model.profiling.context.ProfileContext.model>`): built here, not in :mod:`.context`, which the
hookspecs import and which must therefore import nothing that leads back to them."""

from __future__ import annotations

from typing import Any

import torch

from gem_model.config import RunConfig
from gem_model.model.gem import GemModel
from gem_model.resolve import resolve_components
from gem_model.train import prepare


def initial_model(config: RunConfig, plugins: Any, device: torch.device) -> GemModel:
    """Rank 0's initial model of ``config`` on ``device``: float32, unconverted, tables drawn."""
    components = resolve_components(config, plugins)
    model = prepare.initial_model(config, components, components.source.feature_spec())
    if model.tables_on_meta:  # model.table_init: device (a planner would draw them; here the profile does)
        model.materialize_tables(device)
    return model.to(device)
