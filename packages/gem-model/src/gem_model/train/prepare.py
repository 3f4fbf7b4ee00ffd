"""Model preparation, always in this order (each step sees the result of the one before):

1. the precision scheme swaps dense ``nn.Linear`` modules (per-module overrides, exclusions, min dims);
2. the activation policy (checkpointing or fp8 saved activations) wraps the HSTU blocks;
3. optional ``torch.compile`` of the blocks;
4. the parallel planner places the model (torchrec sharding for tables; DDP or others for dense).

Precision comes before the activation policy so that a checkpointed block recomputes the converted
linears, and both come before the planner so that sharding/DDP wrap the final modules.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from gem_model.components import (
    ActivationPolicy,
    CommStrategy,
    ParallelPlanner,
    PrecisionScheme,
    PreparedModel,
    SparseOptimizerSpec,
)
from gem_model.config import ActivationConfig, PrecisionConfig
from gem_model.distributed import DistEnv
from gem_model.model.gem import GemModel


def _set_submodule(root: nn.Module, fqn: str, module: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, module)


def precision_plan(model: nn.Module, config: PrecisionConfig) -> dict[str, str | None]:
    """Module name -> scheme name (None: left as is) for every dense linear of the model."""
    plan: dict[str, str | None] = {}
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear) or fqn.startswith("sparse."):
            continue
        override = next((name for pat, name in config.overrides.items() if fnmatchcase(fqn, pat)), None)
        if override is not None:
            plan[fqn] = override
        elif any(fnmatchcase(fqn, pat) for pat in config.exclude):
            plan[fqn] = None
        elif min(module.in_features, module.out_features) < config.min_dim:
            plan[fqn] = None
        else:
            plan[fqn] = config.scheme.name
    return plan


def apply_precision(
    model: nn.Module, config: PrecisionConfig, schemes: dict[str, PrecisionScheme]
) -> dict[str, str | None]:
    plan = precision_plan(model, config)
    for fqn, scheme_name in plan.items():
        if scheme_name is None:
            continue
        linear = model.get_submodule(fqn)
        converted = schemes[scheme_name].convert_linear(linear, fqn)
        if converted is not linear:
            _set_submodule(model, fqn, converted)
    return plan


def apply_activation(
    model: GemModel, config: ActivationConfig, policies: dict[str, ActivationPolicy]
) -> dict[str, str]:
    plan: dict[str, str] = {}
    for fqn in model.activation_blocks():
        name = next((n for pat, n in config.overrides.items() if fnmatchcase(fqn, pat)), config.policy.name)
        block = model.get_submodule(fqn)
        wrapped = policies[name].wrap_block(block, fqn)
        if wrapped is not block:
            _set_submodule(model, fqn, wrapped)
        plan[fqn] = name
    return plan


def prepare_model(
    model: GemModel,
    *,
    precision_config: PrecisionConfig,
    schemes: dict[str, PrecisionScheme],
    activation_config: ActivationConfig,
    policies: dict[str, ActivationPolicy],
    compile_blocks: bool,
    planner: ParallelPlanner,
    env: DistEnv,
    comm: CommStrategy,
    sparse_optimizer: SparseOptimizerSpec,
) -> tuple[PreparedModel, dict[str, object]]:
    precision = apply_precision(model, precision_config, schemes)  # 1
    activation = apply_activation(model, activation_config, policies)  # 2
    if compile_blocks:  # 3
        for fqn in model.activation_blocks():
            model.get_submodule(fqn).compile()
    prepared = planner.prepare(model, env=env, comm=comm, sparse_optimizer=sparse_optimizer)  # 4
    return prepared, {"precision": precision, "activation": activation}
