"""From a validated run config and the registries to component instances, before any process group.

Every name is looked up and every component's ``options`` are validated against its ``Config``;
all problems are reported together.
"""

from __future__ import annotations

from dataclasses import dataclass

from gem_model.components import (
    ActivationPolicy,
    CommStrategy,
    Component,
    DataSource,
    JaggedAttentionKernel,
    LoadBalancer,
    NormGateKernel,
    ParallelPlanner,
    PrecisionScheme,
)
from gem_model.config import ComponentRef, RunConfig
from gem_model.config_io import validate
from gem_model.errors import ConfigError, UnknownNameError
from gem_model.plugins import GemPluginManager
from gem_model.registry import Registry


@dataclass
class Components:
    attention: JaggedAttentionKernel
    norm_gate: NormGateKernel
    precision: dict[str, PrecisionScheme]  # by scheme name: the default and every override
    activation: dict[str, ActivationPolicy]
    planner: ParallelPlanner
    comm: CommStrategy
    source: DataSource
    balancer: LoadBalancer


class _Resolver:
    def __init__(self) -> None:
        self.unknown: list[str] = []
        self.bad: list[tuple[str, object, str]] = []

    def build(self, registry: Registry, ref: ComponentRef, path: str) -> Component | None:
        try:
            entry = registry.get(ref.name)
        except UnknownNameError as exc:
            self.unknown.append(str(exc).replace(registry.config_path, path, 1))
            return None
        try:
            options = validate(ref.options, entry.cls.Config, prefix=f"{path}.options")
        except ConfigError as exc:
            self.bad += exc.problems
            return None
        try:
            return entry.cls(options)
        except (ValueError, TypeError) as exc:
            self.bad.append((f"{path}.options", ref.options, str(exc)))
            return None


def resolve_components(config: RunConfig, pm: GemPluginManager) -> Components:
    """Instantiate every component the config names; raise one error listing every problem."""
    r = _Resolver()
    precision = {config.precision.scheme.name: r.build(pm.precision_schemes, config.precision.scheme, "precision.scheme")}
    for pattern, name in config.precision.overrides.items():
        if name not in precision:
            precision[name] = r.build(pm.precision_schemes, ComponentRef(name=name), f"precision.overrides.{pattern}")
    activation = {
        config.activation.policy.name: r.build(pm.activation_policies, config.activation.policy, "activation.policy")
    }
    for pattern, name in config.activation.overrides.items():
        if name not in activation:
            activation[name] = r.build(pm.activation_policies, ComponentRef(name=name), f"activation.overrides.{pattern}")
    built = {
        "attention": r.build(
            pm.kernel_registry("jagged_attention"), config.kernels.jagged_attention, "kernels.jagged_attention"
        ),
        "norm_gate": r.build(pm.kernel_registry("norm_gate"), config.kernels.norm_gate, "kernels.norm_gate"),
        "planner": r.build(pm.parallel_planners, config.parallel.planner, "parallel.planner"),
        "comm": r.build(pm.comm_strategies, config.comm.strategy, "comm.strategy"),
        "source": r.build(pm.data_sources, config.data.source, "data.source"),
        "balancer": r.build(pm.load_balancers, config.data.balancer, "data.balancer"),
    }
    if r.unknown:
        raise UnknownNameError("\n".join(r.unknown))
    if r.bad:
        raise ConfigError(r.bad)
    return Components(precision=precision, activation=activation, **built)  # type: ignore[arg-type]
