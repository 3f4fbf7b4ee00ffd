"""The public plugin interface of gem-model, in one module (``docs/plugins.md`` describes it).

A plugin needs nothing else: the ``hookimpl`` marker, the interfaces its classes subclass, the run
context its lifecycle hooks receive, the layout and plan types, and the result types. Each name is
defined in a small module of its own (listed beside it), all of them importable without the trainer.
"""

from __future__ import annotations

from gem_model.components import (  # the component interfaces
    GEMM_BITS,
    ActivationPolicy,
    CommStrategy,
    Component,
    ComponentConfig,
    DataSource,
    JaggedAttentionKernel,
    Kernel,
    LoadBalancer,
    NormGateKernel,
    ParallelPlanner,
    PrecisionScheme,
    PreparedModel,
    SparseOptimizerSpec,
)
from gem_model.context import Optimizers, RunContext  # what lifecycle hooks receive
from gem_model.layout import Layout  # named parallel dims, degrees, coordinates, groups
from gem_model.lifecycle import Callback, TrainPipeline  # the step's stages; lifecycle plugins
from gem_model.markers import hookimpl
from gem_model.plan import DensePlacement, Plan, TablePlacement  # a planner's decision, plain data
from gem_model.profiling.context import MeasuredSteps, ProfileCommand, ProfileContext  # gem-train profile
from gem_model.profiling.report import ProfileSection, ProfileTable, Recommendation  # a profile's data
from gem_model.protocols import ShardableModel, Stateful  # what the core needs of models, components
from gem_model.results import ReportSection, RunSummary, StepResult  # what a run hands back

# isort: split
# --- the plugin author's door (ux, issue 33 req. 8): what a plugin and its tests reach for beyond
# the interfaces: the plugin manager and its registries, the errors a plugin raises or expects, the
# data types a source or a kernel test builds, and the jagged helpers of the attention contract.
from gem_model.data.batch import Batch, FeatureSpec, PooledFeature  # what a data source returns
from gem_model.distributed import DistEnv  # the process a planner or comm strategy runs in
from gem_model.errors import (  # raised by plugins and the core: exit 2 for ConfigError, UnknownNameError
    ConfigError,
    DuplicateNameError,
    GemError,
    KernelUnavailableError,
    PluginError,
    UnknownNameError,
)
from gem_model.jagged import offsets_of, relative_bias_matrix, time_bias_matrix, time_buckets  # kernel references
from gem_model.plugins import GemPluginManager  # the registries: pm.precision_schemes, pm.kernel_registry(op)
from gem_model.registry import Entry, Provider, Registry  # a registry's names, classes and providers

__all__ = [  # noqa: RUF022 - grouped: the door's names apart, for merges
    "GEMM_BITS",
    # the plugin author's door (ux)
    "Batch",
    "ConfigError",
    "DistEnv",
    "DuplicateNameError",
    "Entry",
    "FeatureSpec",
    "GemError",
    "GemPluginManager",
    "KernelUnavailableError",
    "PluginError",
    "PooledFeature",
    "Provider",
    "Registry",
    "UnknownNameError",
    "offsets_of",
    "relative_bias_matrix",
    "time_bias_matrix",
    "time_buckets",
    # the interfaces, the run context, layout, plan and results
    "ActivationPolicy",
    "Callback",
    "CommStrategy",
    "Component",
    "ComponentConfig",
    "DataSource",
    "DensePlacement",
    "JaggedAttentionKernel",
    "Kernel",
    "Layout",
    "LoadBalancer",
    "MeasuredSteps",
    "NormGateKernel",
    "Optimizers",
    "ParallelPlanner",
    "Plan",
    "PrecisionScheme",
    "PreparedModel",
    "ProfileCommand",
    "ProfileContext",
    "ProfileSection",
    "ProfileTable",
    "Recommendation",
    "ReportSection",
    "RunContext",
    "RunSummary",
    "ShardableModel",
    "SparseOptimizerSpec",
    "Stateful",
    "StepResult",
    "TablePlacement",
    "TrainPipeline",
    "hookimpl",
]
