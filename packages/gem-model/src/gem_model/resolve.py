"""From a validated run config and the registries to component instances, before any process group.

Every name is looked up and every component's ``options`` are validated against its ``Config``;
all problems are reported together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gem_model.components import (
    ActivationPolicy,
    CommStrategy,
    Component,
    DataSource,
    JaggedAttentionKernel,
    LoadBalancer,
    NextItemLossKernel,
    NormGateKernel,
    ParallelPlanner,
    PrecisionScheme,
    SequenceInputKernel,
    SequencePoolKernel,
)
from gem_model.config import ComponentRef, RunConfig
from gem_model.config_io import validate
from gem_model.errors import ConfigError, UnknownNameError
from gem_model.lifecycle import Callback, TrainPipeline
from gem_model.plugins import GemPluginManager
from gem_model.protocols import Stateful
from gem_model.registry import Registry

if TYPE_CHECKING:
    import torch

    from gem_model.data.batch import FeatureSpec
    from gem_model.protocols import ShardableModel
    from gem_model.run_shape import RunShape


@dataclass
class Components:
    attention: JaggedAttentionKernel
    norm_gate: NormGateKernel
    sequence_input: SequenceInputKernel
    sequence_pool: SequencePoolKernel
    next_item_loss: NextItemLossKernel
    precision: dict[str, PrecisionScheme]  # by scheme name: the default and every override
    activation: dict[str, ActivationPolicy]
    planner: ParallelPlanner
    comm: CommStrategy
    source: DataSource
    balancer: LoadBalancer
    pipeline: TrainPipeline
    callbacks: dict[str, Callback] = field(default_factory=dict)  # by name, in config order

    def named(self) -> list[tuple[str, str, Component]]:
        """(registry, name, instance) of every component of the run: what checkpoints key state by."""
        out: list[tuple[str, str, Component]] = [
            ("kernels.jagged_attention", self.attention.name, self.attention),
            ("kernels.norm_gate", self.norm_gate.name, self.norm_gate),
            ("kernels.sequence_input", self.sequence_input.name, self.sequence_input),
            ("kernels.sequence_pool", self.sequence_pool.name, self.sequence_pool),
            ("kernels.next_item_loss", self.next_item_loss.name, self.next_item_loss),
        ]
        out += [("precision_schemes", n, c) for n, c in self.precision.items()]
        out += [("activation_policies", n, c) for n, c in self.activation.items()]
        out += [
            ("parallel_planners", self.planner.name, self.planner),
            ("comm_strategies", self.comm.name, self.comm),
            ("data_sources", self.source.name, self.source),
            ("load_balancers", self.balancer.name, self.balancer),
            ("train_pipelines", self.pipeline.name, self.pipeline),
        ]
        out += [("callbacks", n, c) for n, c in self.callbacks.items()]
        return out

    def stateful(self) -> dict[str, dict[str, Stateful]]:
        """Registry -> name -> the components that keep state of their own (:class:`Stateful`)."""
        out: dict[str, dict[str, Stateful]] = {}
        for registry, name, component in self.named():
            if isinstance(component, Stateful):
                out.setdefault(registry, {})[name] = component
        return out


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
    built, r = _resolve(config, pm)
    if r.unknown:
        raise UnknownNameError("\n".join(r.unknown))
    if r.bad:
        raise ConfigError(r.bad)
    return Components(**built)


@dataclass
class Resolution:
    """What :func:`resolve_partially` could build: each component by its ``Components`` field, None
    where its name is unknown or its options are refused, and those problems."""

    built: dict[str, Any]
    unknown: list[str]
    bad: list[tuple[str, object, str]]

    def components(self) -> Components | None:
        """The whole :class:`Components`, or None when one of them could not be built."""
        return None if self.unknown or self.bad else Components(**self.built)


def resolve_partially(config: RunConfig, pm: GemPluginManager) -> Resolution:
    """Build what can be built and collect the rest's problems (for a check that reports all at once)."""
    built, r = _resolve(config, pm)
    return Resolution(built, r.unknown, r.bad)


def _resolve(config: RunConfig, pm: GemPluginManager) -> tuple[dict[str, Any], _Resolver]:
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
        "sequence_input": r.build(
            pm.kernel_registry("sequence_input"), config.kernels.sequence_input, "kernels.sequence_input"
        ),
        "sequence_pool": r.build(
            pm.kernel_registry("sequence_pool"), config.kernels.sequence_pool, "kernels.sequence_pool"
        ),
        "next_item_loss": r.build(
            pm.kernel_registry("next_item_loss"), config.kernels.next_item_loss, "kernels.next_item_loss"
        ),
        "planner": r.build(pm.parallel_planners, config.parallel.planner, "parallel.planner"),
        "comm": r.build(pm.comm_strategies, config.comm.strategy, "comm.strategy"),
        "source": r.build(pm.data_sources, config.data.source, "data.source"),
        "balancer": r.build(pm.load_balancers, config.data.balancer, "data.balancer"),
        "pipeline": r.build(pm.train_pipelines, config.trainer.pipeline, "trainer.pipeline"),
    }
    callbacks = {ref.name: r.build(pm.callbacks, ref, f"callbacks.{i}") for i, ref in enumerate(config.callbacks)}
    return {"precision": precision, "activation": activation, "callbacks": callbacks, **built}, r


def build_balancer(config: RunConfig, pm: GemPluginManager, name: str, spec: FeatureSpec) -> LoadBalancer:
    """The registered balancer ``name`` as a run of ``config`` would use it (the profile and the
    benchmarks compare balancers this way): the config's options when the config names it, else its
    defaults, bound to the config's model (a cost-aware balancer reads its costs off it)."""
    entry = pm.load_balancers.get(name)
    configured = config.data.balancer
    balancer: LoadBalancer = entry.cls(entry.cls.Config.model_validate(configured.options if configured.name == name else {}))
    balancer.bind_model(config.model, spec)
    return balancer


def run_shape(config: RunConfig, components: Components, *, ranks_per_node: int | None = None) -> RunShape:
    """The :class:`~gem_model.run_shape.RunShape` of a run of ``config`` with its resolved ``components``:
    the model built on the meta device and the data's lengths read, each on first use."""
    from gem_model.run_shape import RunShape

    def build_model() -> ShardableModel:
        import torch

        from gem_model.model.gem import GemModel

        with torch.device("meta"):
            return GemModel(
                config.model.model_copy(update={"table_init": "device"}), components.source.feature_spec(),
                attention=components.attention, norm_gate=components.norm_gate,
                sequence_pool=components.sequence_pool, sequence_input=components.sequence_input,
                next_item_loss=components.next_item_loss,
                seed=config.trainer.seed,
            )  # fmt: skip

    def read_lengths(batches: int) -> torch.Tensor:
        import torch

        batch = config.data.global_batch_size
        return torch.cat([components.source.lengths(step, batch) for step in range(batches)])

    from gem_model.precision import activation_dtype_of

    dtype = activation_dtype_of(config.precision, components.precision)
    return RunShape(config, ranks_per_node, build_model, read_lengths, components.source.feature_spec(), dtype)


def dump_resolved(config: RunConfig, components: Components) -> str:
    """The config as YAML with each component's options as its ``Config`` filled them (every
    option, defaults included): what ``gem-train config`` prints."""
    import yaml

    data = config.model_dump(mode="json")
    for path, component in component_paths(config, components):
        node = data
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = {"name": component.name, "options": component.config.model_dump(mode="json")}
    return yaml.safe_dump(data, sort_keys=False)


def component_paths(config: RunConfig, components: Components) -> list[tuple[list[str | int], Component]]:
    """(path in the config's data, the component built from it) of every component reference."""
    out: list[tuple[list[str | int], Component]] = [
        (["kernels", "jagged_attention"], components.attention),
        (["kernels", "norm_gate"], components.norm_gate),
        (["kernels", "sequence_input"], components.sequence_input),
        (["kernels", "sequence_pool"], components.sequence_pool),
        (["kernels", "next_item_loss"], components.next_item_loss),
        (["precision", "scheme"], components.precision[config.precision.scheme.name]),
        (["activation", "policy"], components.activation[config.activation.policy.name]),
        (["parallel", "planner"], components.planner),
        (["comm", "strategy"], components.comm),
        (["data", "source"], components.source),
        (["data", "balancer"], components.balancer),
        (["trainer", "pipeline"], components.pipeline),
    ]
    out += [(["callbacks", i], components.callbacks[ref.name]) for i, ref in enumerate(config.callbacks)]
    return out
