"""gem-model's own components, registered through the same hooks as any plugin."""

from __future__ import annotations

from gem_model.markers import hookimpl


@hookimpl
def gem_register_data_sources():
    return []


@hookimpl
def gem_register_load_balancers():
    return []
