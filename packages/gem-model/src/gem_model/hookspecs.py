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
    from gem_model.context import RunContext
    from gem_model.lifecycle import Callback, TrainPipeline
    from gem_model.profiling.context import ProfileCommand, ProfileContext
    from gem_model.profiling.report import ProfileSection
    from gem_model.results import ReportSection, RunSummary, StepResult

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


@hookspec
def gem_register_train_pipelines() -> list[type[TrainPipeline]]:
    """Return train pipeline classes (how a step's forward and loss, backward and optimizer step
    run), selected by ``trainer.pipeline``; gem-model registers ``sequential``."""


@hookspec
def gem_register_callbacks() -> list[type[Callback]]:
    """Return callback classes (lifecycle plugins), switched on by the config's ``callbacks`` list.

    A callback's lifecycle hooks are methods of the class; only a run whose config names it
    builds and registers an instance, so an installed callback alone does nothing.
    """


# ---------------------------------------------------------------------------------------- lifecycle
# ``run`` is the :class:`~gem_model.context.RunContext` (config, layout, plan, model, optimizers,
# comm strategy, output directory, device, step). They are implemented by the core, by callbacks
# the config names, and by objects a program registers itself (``GemPluginManager.register``);
# an installed plugin module that implements one directly is refused (it would run unasked).


@hookspec
def gem_run_started(run: RunContext) -> None:
    """Called on every rank once the model, optimizers and data are built, before the first step
    (after a resume has restored the state, so ``run.step`` is the first step to run)."""


@hookspec(firstresult=True)
def gem_train_step(run: RunContext, step: int) -> StepResult:
    """Run one training step and return its :class:`~gem_model.results.StepResult`.

    The core implements it (the step itself, registered ``trylast``; its stages are the
    ``trainer.pipeline``'s). Plugins observe or alter the step by wrapping it with
    ``@hookimpl(wrapper=True)``: a generator that yields once, receives the step's result as the
    value of the ``yield`` and returns it (or a replacement). Profilers and meters observe the loop
    this way without editing it. ``firstresult``: one result per step.
    """


@hookspec
def gem_run_finished(run: RunContext, summary: RunSummary) -> None:
    """Called on every rank after the last step (not after a failure)."""


@hookspec
def gem_report_sections(run: RunContext, summary: RunSummary) -> list[ReportSection]:
    """Return extra sections for the end-of-run report (rank 0 prints them after the summary)."""


# ---------------------------------------------------------------------------------------- profiling
# Called by ``gem-train profile`` only, never in a run: an installed plugin module may implement
# them directly (a profile is asked for by its command, so nothing runs unasked).


@hookspec
def gem_profile_sections(profile: ProfileContext) -> list[ProfileSection]:
    """Return extra sections for ``gem-train profile``'s report, made from ``profile``
    (:class:`~gem_model.profiling.context.ProfileContext`: the config, the registries, the device, the
    assumed world and data-parallel degree, the measured steps and the sections made so far).

    Called once on global rank 0 after the core's sections (sequences, balance, step time, memory,
    communication) and before MFU and the recommendations, which rank every section's
    ``recommendations`` together. Section names must be unique across the report.

    Each plugin's implementation is called on its own, under ``--section-budget`` (cut off past it);
    it is called only when ``--sections`` selects one of the names it declares
    (``gem_profile_section_names``), and it should make only those ``profile.wants(name)`` accepts.
    ``profile.measured`` is None when the selection left the measured steps out.
    """


@hookspec
def gem_profile_section_names() -> list[str]:
    """Return the names of the sections this plugin's ``gem_profile_sections`` makes, so
    ``gem-train profile --sections a,b`` can check the names it is given and call only the plugins
    it needs. A plugin that declares none is called only when every section is asked for."""


@hookspec
def gem_profile_commands() -> list[ProfileCommand]:
    """Return ``gem-train profile <name>`` subcommands (:class:`~gem_model.profiling.context.ProfileCommand`:
    a name, a help line, a function that declares its argparse options and one that runs it).
    gem-precision adds ``precision`` (the per-linear sensitivity probe) this way."""
