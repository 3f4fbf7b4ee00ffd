"""gem-model's own components, registered through the same hooks as any plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gem_model.markers import hookimpl

if TYPE_CHECKING:
    from gem_model.train.run import Run, StepResult


@hookimpl
def gem_register_data_sources():
    from gem_model.data.movielens import MovieLensSource
    from gem_model.data.synthetic import SyntheticSource

    return [SyntheticSource, MovieLensSource]


@hookimpl
def gem_register_load_balancers():
    from gem_model.data.balance import RoundRobinBalancer

    return [RoundRobinBalancer]


@hookimpl(trylast=True)
def gem_train_step(run: Run, step: int) -> StepResult:
    """The step itself; plugins wrap it with ``@hookimpl(wrapper=True)``."""
    return run.execute_step(step)
