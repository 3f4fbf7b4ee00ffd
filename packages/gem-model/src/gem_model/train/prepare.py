"""Model preparation, always in this order (each step sees the result of the one before):

1. the precision policy (:mod:`gem_model.precision`): the scheme swaps dense ``nn.Linear`` modules
   (per-module overrides, exclusions, min dims) and the model's activation dtype is set;
2. the activation policy (checkpointing or fp8 saved activations) wraps the HSTU blocks;
3. optional ``torch.compile`` of the blocks;
4. the parallel planner places the model (torchrec sharding for tables; DDP or others for dense).

Precision comes before the activation policy so that a checkpointed block recomputes the converted
linears, and both come before the planner so that sharding/DDP wrap the final modules.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

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
from gem_model.precision import apply_precision, precision_plan, set_submodule

__all__ = ["apply_activation", "apply_precision", "precision_plan", "prepare_model"]


def apply_activation(
    model: GemModel, config: ActivationConfig, policies: dict[str, ActivationPolicy]
) -> dict[str, str]:
    plan: dict[str, str] = {}
    for fqn in model.activation_blocks():
        name = next((n for pat, n in config.overrides.items() if fnmatchcase(fqn, pat)), config.policy.name)
        block = model.get_submodule(fqn)
        wrapped = policies[name].wrap_block(block, fqn)
        if wrapped is not block:
            set_submodule(model, fqn, wrapped)
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
    policy = apply_precision(model, precision_config, schemes, env.device)  # 1
    activation = apply_activation(model, activation_config, policies)  # 2
    if compile_blocks:  # 3
        for fqn in model.activation_blocks():
            model.get_submodule(fqn).compile()
    prepared = planner.prepare(model, env=env, comm=comm, sparse_optimizer=sparse_optimizer)  # 4
    return prepared, {"precision": policy.plan, "activation": activation, "policy": policy}
