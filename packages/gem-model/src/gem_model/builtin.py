"""gem-model's own components, registered through the same hooks as any plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from gem_model.markers import hookimpl

if TYPE_CHECKING:
    from gem_model.context import RunContext
    from gem_model.results import StepResult


@hookimpl
def gem_register_kernels():
    from gem_model.model.next_item import TorchNextItemLoss  # the default of kernels.next_item_loss
    from gem_model.model.sequence_input import TorchSequenceInput  # the default of kernels.sequence_input
    from gem_model.model.sequence_pool import TorchSequencePool  # the default of kernels.sequence_pool

    return [TorchNextItemLoss, TorchSequenceInput, TorchSequencePool]


@hookimpl
def gem_register_data_sources():
    from gem_model.data.movielens import MovieLensSource
    from gem_model.data.parquet import ParquetSource  # pyarrow is imported when one is built
    from gem_model.data.synthetic import SyntheticSource

    return [SyntheticSource, MovieLensSource, ParquetSource]


@hookimpl
def gem_register_load_balancers():
    from gem_model.data.balance import RoundRobinBalancer

    return [RoundRobinBalancer]


@hookimpl
def gem_register_train_pipelines():
    from gem_model.train.pipeline import SequentialPipeline

    return [SequentialPipeline]


@hookimpl(trylast=True)
def gem_train_step(run: RunContext, step: int) -> StepResult:
    """The step itself; plugins wrap it with ``@hookimpl(wrapper=True)``."""
    assert run._execute_step is not None, "the RunContext of a run built by gem_model.train.run.Run"
    return run._execute_step(step)
