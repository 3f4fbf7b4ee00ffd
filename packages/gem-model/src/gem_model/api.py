"""The public plugin interface of gem-model, in one module (``docs/plugins.md`` describes it).

A plugin imports nothing else of the core than this module (and :mod:`gem_model.testing` in its
tests): a test parses every plugin module's imports and fails on any other. Each name is defined
in a small module of its own (listed below); they are imported on first use, so ``from
gem_model.api import hookimpl`` in a plugin's ``plugin.py`` imports neither torchrec nor the
trainer, and a plugin module imports only what it names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from gem_model.markers import hookimpl

_EXPORTS: dict[str, tuple[str, ...]] = {
    # the component interfaces, and what planners and kernels hand back
    "gem_model.components": (
        "GEMM_BITS", "NO_EXTRAS", "ActivationPolicy", "AttentionExtras", "CommStrategy", "Component", "ComponentConfig", "DataSource",
        "JaggedAttentionKernel", "Kernel", "LoadBalancer", "NextItemLossKernel", "NormGateKernel", "ParallelPlanner",
        "PlannerContext", "PrecisionScheme", "PreparedModel", "SequenceInputKernel", "SequencePoolKernel",
        "SparseOptimizerSpec",
    ),
    "gem_model.context": ("Optimizers", "RunContext"),  # what lifecycle hooks receive
    "gem_model.lifecycle": ("Callback", "TrainPipeline"),  # the step's stages; lifecycle plugins
    "gem_model.protocols": ("ShardableModel", "Stateful"),  # what the core needs of models, components
    # a linear that takes its input pre-quantized by the kernel that produced it
    "gem_model.prequantized": (
        "PrequantizedInputLinear", "PrequantizedRows", "RowQuantization", "call_linear", "wanted_quantization",
    ),
    # ... and the backward's side: a linear whose output gradient arrives quantized by its producer
    "gem_model.grad_rows": ("GradRows", "GradRowsSlot", "attach_grad_rows", "attached_grad_rows", "grad_rows_slot"),
    # a kernel that writes a table lookup's gradient straight into the lookup's one gradient buffer
    "gem_model.table_grad": ("GradSection", "grad_section", "table_views"),
    "gem_model.linear_bias": ("bias_grad_elsewhere", "lent_from"),  # a linear whose bias gradient a fused kernel sums
    "gem_model.linear_gemm": ("GemmTakingLinear", "LinearGemm", "takes_gemm"),  # ... whose forward GEMM a kernel supplies
    "gem_model.results": ("ReportSection", "RunSummary", "StepResult"),  # what a run hands back
    # the parallel degrees, their runtime view, the run a planner lays out, a planner's decision
    "gem_model.parallel_dims": (
        "DATA_DIMS", "LOSS_DIMS", "MESH_DIMS", "SPARSE_GROUP", "SPARSE_REPLICA_GROUP", "ParallelDims", "dims_of",
    ),
    "gem_model.layout": ("Layout",),
    "gem_model.run_shape": ("RunShape",),
    "gem_model.plan": ("DensePlacement", "Plan", "TablePlacement"),
    "gem_model.distributed": ("DistEnv", "pick_device"),
    "gem_model.precision": ("PrecisionPolicy", "precision_plan", "set_submodule"),
    # saved activations compressed by a block's own kernels, at an activation policy's request
    "gem_model.saved_format": ("E4M3_ROW", "SAVED_FORMATS", "SavedFormatBlock"),
    # the config, and the errors a plugin raises or expects
    "gem_model.config": ("ComponentRef", "ModelConfig", "PrecisionConfig", "RunConfig"),
    "gem_model.config_io": ("load_config",),
    "gem_model.errors": (
        "ConfigError", "DuplicateNameError", "GemError", "KernelUnavailableError", "PluginError", "UnknownNameError",
    ),
    "gem_model.plugins": ("GemPluginManager",),  # the registries: pm.precision_schemes, pm.kernel_registry(op)
    "gem_model.registry": ("Entry", "Provider", "Registry"),  # a registry's names, classes and providers
    "gem_model.resolve": ("resolve_components", "run_shape"),
    # the data a step sees
    "gem_model.data.batch": ("Batch", "FeatureSpec", "PooledFeature"),
    "gem_model.data.loader": ("ShardedLoader",),
    "gem_model.data.prefetch": ("StagedBatch", "batch_tensors"),
    "gem_model.host_copy": ("to_device_async",),  # a small host tensor on the device without blocking the host
    # jagged sequences and the attention biases' reference math (kernels share them)
    "gem_model.jagged": (
        "TIME_BUCKET_STEP", "gather_bias", "offsets_of", "relative_bias_matrix", "sequence_ids", "time_bias_matrix",
        "time_bucket_matrix", "time_buckets",
    ),
    # the model and its cost
    "gem_model.model.gem": ("GemModel",),
    "gem_model.model.flops": ("count_flops",),
    # the next-item loss (the core's kernel of kernels.next_item_loss) and its L2 normalisation
    "gem_model.model.next_item": ("L2_EPS", "next_item_loss", "unit_rows", "unit_rows_vjp"),
    # the sequence pool as torch ops (the core's kernel of kernels.sequence_pool) and its input checks
    "gem_model.model.sequence_pool": ("check_sequence_pool_inputs", "sequence_pool_torch"),
    # the sequence input as torch ops (the core's kernel of kernels.sequence_input) and its input checks
    "gem_model.model.sequence_input": ("check_sequence_input_inputs", "sequence_input_torch"),
    "gem_model.profiling.memory": ("MemoryFit", "step_loss"),
    # gem-train profile
    "gem_model.profiling.context": ("MeasuredSteps", "ProfileCommand", "ProfileContext"),
    "gem_model.profiling.report": ("ProfileSection", "ProfileTable", "Recommendation"),
    "gem_model.profiling.parts": ("profile_context",),
}  # fmt: skip
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = [
    "DATA_DIMS",
    "E4M3_ROW",
    "GEMM_BITS",
    "L2_EPS",
    "LOSS_DIMS",
    "MESH_DIMS",
    "NO_EXTRAS",
    "SAVED_FORMATS",
    "SPARSE_GROUP",
    "SPARSE_REPLICA_GROUP",
    "TIME_BUCKET_STEP",
    "ActivationPolicy",
    "AttentionExtras",
    "Batch",
    "Callback",
    "CommStrategy",
    "Component",
    "ComponentConfig",
    "ComponentRef",
    "ConfigError",
    "DataSource",
    "DensePlacement",
    "DistEnv",
    "DuplicateNameError",
    "Entry",
    "FeatureSpec",
    "GemError",
    "GemModel",
    "GemPluginManager",
    "GemmTakingLinear",
    "GradRows",
    "GradRowsSlot",
    "GradSection",
    "JaggedAttentionKernel",
    "Kernel",
    "KernelUnavailableError",
    "Layout",
    "LinearGemm",
    "LoadBalancer",
    "MeasuredSteps",
    "MemoryFit",
    "ModelConfig",
    "NextItemLossKernel",
    "NormGateKernel",
    "Optimizers",
    "ParallelDims",
    "ParallelPlanner",
    "Plan",
    "PlannerContext",
    "PluginError",
    "PooledFeature",
    "PrecisionConfig",
    "PrecisionPolicy",
    "PrecisionScheme",
    "PreparedModel",
    "PrequantizedInputLinear",
    "PrequantizedRows",
    "ProfileCommand",
    "ProfileContext",
    "ProfileSection",
    "ProfileTable",
    "Provider",
    "Recommendation",
    "Registry",
    "ReportSection",
    "RowQuantization",
    "RunConfig",
    "RunContext",
    "RunShape",
    "RunSummary",
    "SavedFormatBlock",
    "SequenceInputKernel",
    "SequencePoolKernel",
    "ShardableModel",
    "ShardedLoader",
    "SparseOptimizerSpec",
    "StagedBatch",
    "Stateful",
    "StepResult",
    "TablePlacement",
    "TrainPipeline",
    "UnknownNameError",
    "attach_grad_rows",
    "attached_grad_rows",
    "batch_tensors",
    "bias_grad_elsewhere",
    "call_linear",
    "check_sequence_input_inputs",
    "check_sequence_pool_inputs",
    "count_flops",
    "dims_of",
    "gather_bias",
    "grad_rows_slot",
    "grad_section",
    "hookimpl",
    "lent_from",
    "load_config",
    "next_item_loss",
    "offsets_of",
    "pick_device",
    "precision_plan",
    "profile_context",
    "relative_bias_matrix",
    "resolve_components",
    "run_shape",
    "sequence_ids",
    "sequence_input_torch",
    "sequence_pool_torch",
    "set_submodule",
    "step_loss",
    "table_views",
    "takes_gemm",
    "time_bias_matrix",
    "time_bucket_matrix",
    "time_buckets",
    "to_device_async",
    "unit_rows",
    "unit_rows_vjp",
    "wanted_quantization",
]
"""Every name above; a test checks the list against the table."""


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'gem_model.api' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return list(__all__)


if TYPE_CHECKING:
    from gem_model.components import (
        GEMM_BITS,
        NO_EXTRAS,
        ActivationPolicy,
        AttentionExtras,
        CommStrategy,
        Component,
        ComponentConfig,
        DataSource,
        JaggedAttentionKernel,
        Kernel,
        LoadBalancer,
        NextItemLossKernel,
        NormGateKernel,
        ParallelPlanner,
        PlannerContext,
        PrecisionScheme,
        PreparedModel,
        SequenceInputKernel,
        SequencePoolKernel,
        SparseOptimizerSpec,
    )
    from gem_model.config import ComponentRef, ModelConfig, PrecisionConfig, RunConfig
    from gem_model.config_io import load_config
    from gem_model.context import Optimizers, RunContext
    from gem_model.data.batch import Batch, FeatureSpec, PooledFeature
    from gem_model.data.loader import ShardedLoader
    from gem_model.data.prefetch import StagedBatch, batch_tensors
    from gem_model.distributed import DistEnv, pick_device
    from gem_model.errors import (
        ConfigError,
        DuplicateNameError,
        GemError,
        KernelUnavailableError,
        PluginError,
        UnknownNameError,
    )
    from gem_model.grad_rows import GradRows, GradRowsSlot, attach_grad_rows, attached_grad_rows, grad_rows_slot
    from gem_model.host_copy import to_device_async
    from gem_model.jagged import (
        TIME_BUCKET_STEP,
        gather_bias,
        offsets_of,
        relative_bias_matrix,
        sequence_ids,
        time_bias_matrix,
        time_bucket_matrix,
        time_buckets,
    )
    from gem_model.layout import Layout
    from gem_model.lifecycle import Callback, TrainPipeline
    from gem_model.linear_bias import bias_grad_elsewhere, lent_from
    from gem_model.linear_gemm import GemmTakingLinear, LinearGemm, takes_gemm
    from gem_model.model.flops import count_flops
    from gem_model.model.gem import GemModel
    from gem_model.model.next_item import L2_EPS, next_item_loss, unit_rows, unit_rows_vjp
    from gem_model.model.sequence_input import check_sequence_input_inputs, sequence_input_torch
    from gem_model.model.sequence_pool import check_sequence_pool_inputs, sequence_pool_torch
    from gem_model.parallel_dims import (
        DATA_DIMS,
        LOSS_DIMS,
        MESH_DIMS,
        SPARSE_GROUP,
        SPARSE_REPLICA_GROUP,
        ParallelDims,
        dims_of,
    )
    from gem_model.plan import DensePlacement, Plan, TablePlacement
    from gem_model.plugins import GemPluginManager
    from gem_model.precision import PrecisionPolicy, precision_plan, set_submodule
    from gem_model.prequantized import (
        PrequantizedInputLinear,
        PrequantizedRows,
        RowQuantization,
        call_linear,
        wanted_quantization,
    )
    from gem_model.profiling.context import MeasuredSteps, ProfileCommand, ProfileContext
    from gem_model.profiling.memory import MemoryFit, step_loss
    from gem_model.profiling.parts import profile_context
    from gem_model.profiling.report import ProfileSection, ProfileTable, Recommendation
    from gem_model.protocols import ShardableModel, Stateful
    from gem_model.registry import Entry, Provider, Registry
    from gem_model.resolve import resolve_components, run_shape
    from gem_model.results import ReportSection, RunSummary, StepResult
    from gem_model.run_shape import RunShape
    from gem_model.saved_format import E4M3_ROW, SAVED_FORMATS, SavedFormatBlock
    from gem_model.table_grad import GradSection, grad_section, table_views
