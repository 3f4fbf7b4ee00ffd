"""Model preparation, always in this order (each step sees the result of the one before):

1. the precision policy (:mod:`gem_model.precision`): the scheme swaps dense ``nn.Linear`` modules
   (per-module overrides, exclusions, min dims) and the model's activation dtype is set;
2. the activation policy (checkpointing or fp8 saved activations) wraps the HSTU blocks;
3. optional ``torch.compile`` of the blocks;
4. the parallel planner plans where every table and dense module goes (plain data, a
   :class:`~gem_model.plan.Plan`), then applies that plan (torchrec sharding for tables; DDP or
   others for dense).

Precision comes before the activation policy so that a checkpointed block recomputes the converted
linears, and both come before the planner so that sharding/DDP wrap the final modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import torch

from gem_model.components import (
    ActivationPolicy,
    CommStrategy,
    ParallelPlanner,
    PlannerContext,
    PrecisionScheme,
    PreparedModel,
    SparseOptimizerSpec,
)
from gem_model.config import ActivationConfig, PrecisionConfig, RunConfig
from gem_model.data.batch import FeatureSpec
from gem_model.distributed import DistEnv, pick_device
from gem_model.layout import Layout
from gem_model.model.gem import GemModel
from gem_model.plan import Plan
from gem_model.precision import PrecisionPolicy, apply_precision, precision_plan, set_submodule
from gem_model.resolve import Components, run_shape
from gem_model.train.optim import sparse_optimizer_spec

__all__ = [
    "Preparation",
    "apply_activation",
    "apply_precision",
    "initial_model",
    "offline_plan",
    "precision_plan",
    "prepare_model",
]


@dataclass(frozen=True)
class Preparation:
    """What :func:`prepare_model` did, step by step."""

    precision: PrecisionPolicy
    """1: the activation dtype and the scheme of every dense linear (``precision.plan``)."""
    activation: dict[str, str]
    """2: block name -> the activation policy that wrapped it."""
    plan: Plan
    """4: where the planner put every table and dense module."""
    prepared: PreparedModel
    """4: the planner's wrapped model and the tables' optimizer."""


def initial_model(config: RunConfig, components: Components, spec: FeatureSpec) -> GemModel:
    """The run's model as every rank first builds it: from rank 0's random stream (some inits,
    ``nn.Linear``'s biases, draw from the global RNG), so that replicas a planner does not broadcast
    (tp groups, state DCP dedups as replicated) start identical. The caller moves the global RNG on
    to its own rank's stream afterwards (dropout)."""
    torch.manual_seed(config.trainer.seed * 1_000)
    return GemModel(config.model, spec, attention=components.attention, norm_gate=components.norm_gate,
                    next_item_loss=components.next_item_loss, sequence_pool=components.sequence_pool,
                    sequence_input=components.sequence_input, seed=config.trainer.seed)  # fmt: skip


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
    layout: Layout,
    env: DistEnv,
    comm: CommStrategy,
    sparse_optimizer: SparseOptimizerSpec,
) -> Preparation:
    policy = apply_precision(model, precision_config, schemes, env.device)  # 1
    activation = apply_activation(model, activation_config, policies)  # 2
    if compile_blocks:  # 3
        for fqn in model.activation_blocks():
            model.get_submodule(fqn).compile()
    ctx = PlannerContext(env, layout, comm, sparse_optimizer)
    plan = planner.plan(model, ctx)  # 4
    return Preparation(policy, activation, plan, planner.apply(model, plan, ctx))


def offline_plan(config: RunConfig, components: Components, *, world_size: int, ranks_per_node: int | None = None) -> Plan:
    """The plan a run of ``config`` on ``world_size`` processes would get, made in this process
    without a process group (``gem-train plan``). The tables are built on the meta device, so a
    plan of tens of GB of tables takes no memory; layout groups are None."""
    device = pick_device(config.trainer.device, 0)
    env = DistEnv(0, world_size, 0, device, None)
    components.planner.bind_run(run_shape(config, components, ranks_per_node=ranks_per_node))
    layout = components.planner.layout(env)
    model_config = config.model.model_copy(update={"table_init": "device"})
    spec = components.source.feature_spec()
    model = GemModel(
        model_config, spec, attention=components.attention, norm_gate=components.norm_gate,
        next_item_loss=components.next_item_loss, sequence_pool=components.sequence_pool,
        sequence_input=components.sequence_input, seed=config.trainer.seed,
    )  # fmt: skip
    ctx = PlannerContext(env, layout, components.comm, sparse_optimizer_spec(config.trainer))
    return components.planner.plan(model, ctx)
