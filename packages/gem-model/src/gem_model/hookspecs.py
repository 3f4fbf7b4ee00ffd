"""Every hook of the ``gem`` project, grouped by phase. No logic lives here.

Implementations may accept fewer arguments than a spec names (pluggy passes only those asked for),
so a spec can gain arguments without breaking existing plugins.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gem_model.markers import hookspec

if TYPE_CHECKING:
    from gem_model.components import (
        ActivationPolicy,
        CommStrategy,
        DataSource,
        Kernel,
        LoadBalancer,
        ParallelPlanner,
        PrecisionScheme,
    )
    from gem_model.train.report import ReportSection, RunSummary
    from gem_model.train.run import Run, StepResult

# ------------------------------------------------------------------------------------- registration
# Called once when the plugin manager builds its registries. Each returns classes, never instances;
# each class has ``name`` and a pydantic ``Config``. A name may be registered by one plugin only.


@hookspec
def gem_register_kernels() -> list[type[Kernel]]:
    """Return kernel classes. Each has ``op`` (e.g. ``jagged_attention``) and ``name`` (e.g.
    ``triton``); the config selects one per op with ``kernels.<op>: <name>``. Names are unique per op.
    """


@hookspec
def gem_register_precision_schemes() -> list[type[PrecisionScheme]]:
    """Return precision scheme classes, selected by ``precision.scheme`` and ``precision.overrides``."""


@hookspec
def gem_register_activation_policies() -> list[type[ActivationPolicy]]:
    """Return activation memory policies (checkpointing, quantized saved tensors), selected by
    ``activation.policy``."""


@hookspec
def gem_register_comm_strategies() -> list[type[CommStrategy]]:
    """Return communication strategy classes, selected by ``comm.strategy``."""


@hookspec
def gem_register_parallel_planners() -> list[type[ParallelPlanner]]:
    """Return parallel planner classes, selected by ``parallel.planner``."""


@hookspec
def gem_register_data_sources() -> list[type[DataSource]]:
    """Return data source classes, selected by ``data.source``."""


@hookspec
def gem_register_load_balancers() -> list[type[LoadBalancer]]:
    """Return load balancer classes (sample-to-rank assignment), selected by ``data.balancer``."""


# ---------------------------------------------------------------------------------------- lifecycle


@hookspec
def gem_run_started(run: Run) -> None:
    """Called on every rank once the model, optimizers and data are built, before the first step."""


@hookspec(firstresult=True)
def gem_train_step(run: Run, step: int) -> StepResult:
    """Run one training step and return its :class:`~gem_model.train.run.StepResult`.

    The core implements it (the step itself, registered ``trylast``). Plugins observe or alter the
    step by wrapping it with ``@hookimpl(wrapper=True)``: a generator that yields once, receives the
    step's result as the value of the ``yield`` and returns it (or a replacement). Profilers and
    meters observe the loop this way without editing it. ``firstresult``: one result per step.
    """


@hookspec
def gem_run_finished(run: Run, summary: RunSummary) -> None:
    """Called on every rank after the last step (not after a failure)."""


@hookspec
def gem_report_sections(run: Run, summary: RunSummary) -> list[ReportSection]:
    """Return extra sections for the end-of-run report (rank 0 prints them after the summary)."""
