"""The interfaces that plugins implement.

Every registered class carries ``name`` (lowercase snake case, unique within its registry) and a
nested pydantic ``Config`` (``extra="forbid"``). The run config names a component by string and may
pass ``options``; the core validates them with the class's ``Config`` and builds ``cls(config)``.

The interfaces are small on purpose: one method per seam of the training step.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from gem_model.component_base import NAME_PATTERN, Component, ComponentConfig
from gem_model.kernels import (
    NO_EXTRAS,
    AttentionExtras,
    JaggedAttentionKernel,
    Kernel,
    NextItemLossKernel,
    NormGateKernel,
    SequenceInputKernel,
    SequencePoolKernel,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from gem_model.config import ModelConfig
    from gem_model.data.batch import Batch, FeatureSpec
    from gem_model.distributed import DistEnv
    from gem_model.layout import Layout
    from gem_model.parallel_dims import ParallelDims
    from gem_model.plan import Plan
    from gem_model.protocols import ShardableModel
    from gem_model.run_shape import RunShape

__all__ = [  # the kernel interfaces and the base live in their own modules; importable from here too
    "NAME_PATTERN", "NO_EXTRAS", "ActivationPolicy", "AttentionExtras", "CommStrategy", "Component", "ComponentConfig",
    "DataSource", "JaggedAttentionKernel", "Kernel", "LoadBalancer", "NextItemLossKernel", "NormGateKernel",
    "ParallelPlanner", "PlannerContext", "PrecisionScheme", "PreparedModel", "SequenceInputKernel", "SequencePoolKernel",
    "SparseOptimizerSpec",
]  # fmt: skip


# ------------------------------------------------------------------------------------ precision, memory


GEMM_BITS: dict[str, int] = {"float32": 32, "bfloat16": 16, "float16": 16, "float8": 8}
"""Bits per GEMM operand of each :attr:`PrecisionScheme.gemm_dtype` value."""


class PrecisionScheme(Component):
    """Numerics of the dense ``nn.Linear`` layers, applied by module swap, and the dtype in which
    activations flow through the whole model when this scheme is the run's ``precision.scheme``.

    The core decides which linears a scheme gets (per-module overrides, minimum dims, exclusions)
    and calls :meth:`convert_linear` for each; embedding tables are never touched. The model then
    runs in :attr:`activation_dtype` (see :mod:`gem_model.precision`): embedding outputs are cast to
    it once, every linear, norm, gate and attention kernel receives it, and losses, logsumexp and
    normalisation statistics are computed in float32. Parameters stay float32 master weights.
    """

    activation_dtype: ClassVar[str] = "float32"
    """``"float32"`` or ``"bfloat16"``: the dtype of the activations between the model's ops under
    this scheme (``precision.activation_dtype: auto`` takes it). A scheme whose GEMMs run in 16 or 8
    bits declares ``"bfloat16"``, so no fp32 copy of an activation is made between two GEMMs."""

    gemm_dtype: ClassVar[str] = "float32"
    """``"float32"``, ``"bfloat16"``, ``"float16"`` or ``"float8"``: the dtype the scheme's GEMMs run
    in on the tensor cores. MFU takes its peak from it (:func:`gem_model.train.metrics.peak_flops`):
    a scheme says what it computes in, so the core keeps no list of scheme names."""

    @abstractmethod
    def convert_linear(self, linear: nn.Linear, fqn: str) -> nn.Module:
        """Return the module that replaces ``linear`` (same call signature, same parameters).

        The returned module must keep ``linear.weight`` and ``linear.bias`` as its parameters (the
        fp32 master weights), so optimizers and checkpoints see the same names. It is called with
        inputs in the run's activation dtype; if it returns another dtype the core casts the output
        back (so a scheme that computes in float16 and returns float32 still fits a bfloat16 model).
        """

    def check_module(self, module: nn.Module, fqn: str, device: torch.device) -> None:
        """Raise ``ValueError`` naming ``fqn`` if ``module`` (from :meth:`convert_linear`) cannot run on
        ``device`` (a backend the device lacks, a shape the GEMM cannot take). Called for every
        converted linear when the run is built, so such a run is refused before it trains."""


class ActivationPolicy(Component):
    """What a block keeps for backward: everything, nothing (recompute), or a compressed copy."""

    @abstractmethod
    def wrap_block(self, block: nn.Module, fqn: str) -> nn.Module:
        """Return the module that replaces ``block`` (same call signature and parameters)."""


# ------------------------------------------------------------------------------- communication, layout


class CommStrategy(Component):
    """Owns the collectives of a run: gradient sync, embedding all-to-all settings, metric reductions.

    The training loop never calls a collective directly; it goes through this object.
    A strategy that changes the reduced values (quantized collectives) sets :attr:`shapes_run`.
    """

    shapes_run: ClassVar[bool | frozenset[str]] = False

    def setup(self, env: DistEnv) -> None:
        """Called once the process group exists (or right away in a single-process run)."""
        self.env = env

    def configure_ddp(self, ddp: DistributedDataParallel) -> None:
        """Install gradient-sync behaviour (comm hooks, bucket settings) on a DDP module."""

    def embedding_qcomms(self) -> Any | None:
        """A torchrec ``QCommsConfig`` for the embedding all-to-all, or None for full precision."""
        return None

    def ddp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``DistributedDataParallel`` that a planner passes when it builds DDP
        (``bucket_cap_mb``, ``gradient_as_bucket_view``): bucketing is fixed once DDP exists, so
        :meth:`configure_ddp` cannot change it. Empty: the planner's own settings."""
        return {}

    def measurements(self) -> dict[str, float]:
        """Running totals of this rank's collectives, as flat numbers (``<kind>.bytes``,
        ``<kind>.calls``, ``<kind>.seconds``); empty when the strategy measures nothing. A caller
        takes differences around a step for per-step values."""
        return {}

    @abstractmethod
    def all_reduce_mean(self, values: torch.Tensor, group: Any = None) -> torch.Tensor:
        """Mean of ``values`` over the ranks of ``group`` (None: all ranks), for logged metrics."""

    @abstractmethod
    def all_reduce_sum(self, values: torch.Tensor, group: Any = None) -> torch.Tensor:
        """Sum of ``values`` over the ranks of ``group`` (None: all ranks). The trainer passes the
        layout's loss group (:attr:`gem_model.layout.Layout.loss_group`) for the step's sums."""


@dataclass
class PreparedModel:
    """What a parallel planner hands back to the trainer."""

    module: nn.Module
    """Called as ``module(batch)``; returns the model's output."""
    dense_parameters: list[tuple[str, torch.nn.Parameter]]
    """Parameters the dense optimizer (AdamW) owns, with their names."""
    sparse_optimizer: Any
    """A torchrec ``KeyedOptimizer`` over the embedding tables (``state_dict``/``load_state_dict``)."""
    sparse_optimizer_fused: bool
    """True when the sparse optimizer steps inside backward (torchrec fused TBE)."""
    plan_summary: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    after_optimizer_step: Callable[[], None] | None = None
    """Called after every optimizer step (the tables' fused update in backward included), e.g. to
    average the table replicas of several sparse groups, as torchrec's ``DMPCollection.sync``."""


@dataclass(frozen=True)
class SparseOptimizerSpec:
    """The embedding tables' optimizer, chosen by the trainer config (``trainer.sparse_optimizer``).

    ``cls(params, **kwargs)`` is a torch optimizer for unsharded tables. A planner that fuses the
    update into torchrec's embedding kernels passes :meth:`fused` to ``apply_optimizer_in_backward``
    instead: ``fused_cls`` (a class torchrec maps to an FBGEMM optimizer) and ``fused_kwargs``
    (FBGEMM's names, e.g. ``beta1``/``beta2``); each defaults to its unfused counterpart.
    """

    cls: type
    kwargs: dict[str, Any]
    fused_cls: type | None = None
    fused_kwargs: dict[str, Any] | None = None
    name: str = ""
    """The ``trainer.sparse_optimizer`` name it was built from (for error messages)."""
    fused_on_cpu: bool = True
    """False where FBGEMM's CPU kernels lack the fused update (its Adam is CUDA only)."""

    def fused(self) -> tuple[type, dict[str, Any]]:
        return (self.fused_cls or self.cls), dict(self.kwargs if self.fused_kwargs is None else self.fused_kwargs)


@dataclass(frozen=True)
class PlannerContext:
    """What :meth:`ParallelPlanner.plan` and :meth:`ParallelPlanner.apply` get besides the model."""

    env: DistEnv
    """This process: rank, world size, device, backend (``env.distributed`` is False when
    ``gem-train plan`` asks for a plan without processes)."""
    layout: Layout
    """The layout :meth:`ParallelPlanner.layout` made for this run."""
    comm: CommStrategy
    """The run's communication strategy (embedding all-to-all codecs, DDP settings)."""
    sparse_optimizer: SparseOptimizerSpec
    """The tables' optimizer (``trainer.sparse_optimizer``)."""


class ParallelPlanner(Component):
    """Chooses the run's parallel degrees, places the model on the devices and wraps it.

    Four stages, as TorchTitan keeps its ``ParallelDims`` and TorchRec its ``ShardingPlan`` apart
    from applying them:

    1. :meth:`dims`, before any process starts: the degrees
       (:class:`~gem_model.parallel_dims.ParallelDims`), which the core checks against the run
       (the heads, the lengths, the batch, the world, the precision) and reports with the
       planner's option paths (:attr:`dims_path`);
    2. :meth:`layout`, before the loader exists: the runtime view of those degrees (mesh, groups);
    3. :meth:`plan`: plain data (:class:`~gem_model.plan.Plan`) saying where every table and dense
       module goes; printed by ``gem-train plan`` and saved beside every checkpoint;
    4. :meth:`apply`: wraps the model as the plan says and hands back a :class:`PreparedModel`.

    A planner sees the model through :class:`~gem_model.protocols.ShardableModel` only.
    """

    max_world_size: ClassVar[int | None] = None
    """The most processes this planner can drive (None: any); checked before processes start."""
    needs_process_group: ClassVar[bool] = False
    """Whether :meth:`apply` needs a process group even at one process (torchrec's sharded tables do):
    ``gem-train run`` then starts torchrun itself, and a run built in a plain process is refused first."""

    dims_path: ClassVar[str] = "parallel.planner.options"
    """Where the user sets this planner's degrees: the prefix of the config paths that the core's
    checks of :meth:`dims` name (``parallel.planner.options.tp``)."""

    def bind_run(self, run: RunShape) -> None:
        """Called once, before :meth:`dims` and :meth:`layout`, with the run this planner lays out
        (its config, the model on the meta device, the data's lengths). The default ignores it."""

    def dims(self, world_size: int) -> ParallelDims:
        """The resolved degrees for ``world_size`` ranks; a :class:`~gem_model.errors.ConfigError`
        names the options that cannot fit it. The default: every rank a data-parallel replica that
        holds every table."""
        from gem_model.parallel_dims import ParallelDims

        return ParallelDims(dp_replicate=world_size, dp_shard=1, sparse=1)

    def layout(self, env: DistEnv) -> Layout:
        """The run's layout of :meth:`dims`. The default: a one-dim layout keeps the default group
        (no mesh); more dims get a ``DeviceMesh`` (:meth:`Layout.build <gem_model.layout.Layout.build>`)."""
        from gem_model.layout import Layout

        dims = self.dims(env.world_size)
        if len(dims.enabled_dims) > 1:
            return Layout.build(dims, env)
        group = None
        if env.distributed:
            import torch.distributed as dist

            group = dist.group.WORLD
        layout = Layout(dims, env.rank)
        return Layout(dims, env.rank, layout.mesh_dims, {layout.mesh_dims[0]: group})

    @abstractmethod
    def plan(self, model: ShardableModel, ctx: PlannerContext) -> Plan:
        """Decide where every table and dense module goes; wrap nothing."""

    @abstractmethod
    def apply(self, model: ShardableModel, plan: Plan, ctx: PlannerContext) -> PreparedModel:
        """Place and wrap ``model`` as ``plan`` says (called on every rank, with a process group
        where the layout has more than one rank)."""

    def prepare(
        self, model: ShardableModel, *, env: DistEnv, comm: CommStrategy, sparse_optimizer: SparseOptimizerSpec
    ) -> PreparedModel:
        """:meth:`layout`, :meth:`plan` and :meth:`apply` in one call (for tests and scripts)."""
        ctx = PlannerContext(env, self.layout(env), comm, sparse_optimizer)
        return self.apply(model, self.plan(model, ctx), ctx)


# ------------------------------------------------------------------------------------------------ data


class DataSource(Component):
    """A deterministic source of global batches, indexed by step.

    The loader first asks for the global batch's sequence lengths, lets the load balancer split the
    samples across ranks, and then materialises only this rank's samples.
    """

    @abstractmethod
    def feature_spec(self) -> FeatureSpec: ...

    @abstractmethod
    def lengths(self, step: int, global_batch_size: int) -> torch.Tensor:
        """Sequence lengths (int64 ``[global_batch_size]``) of the global batch of ``step``."""

    @abstractmethod
    def make_batch(self, step: int, global_batch_size: int, indices: torch.Tensor) -> Batch:
        """The samples ``indices`` (positions within the global batch of ``step``)."""

    def steps_per_epoch(self, global_batch_size: int) -> int | None:
        """Steps in one pass over the data, or None for an endless source."""
        return None

    def evaluate(self, model: nn.Module, *, device: torch.device, split: str) -> dict[str, float] | None:
        """Offline metrics of ``model`` on ``split`` (``"valid"`` or ``"test"``), or None if the source has none.

        Called by the trainer on rank 0 with the unwrapped model in eval mode.
        """
        return None


class LoadBalancer(Component):
    """Assigns the samples of a global batch to data-parallel ranks."""

    @abstractmethod
    def assign(self, lengths: torch.Tensor, world_size: int) -> list[torch.Tensor]:
        """Per data-parallel rank, the indices of its samples; every rank gets the same number.

        ``world_size`` is the layout's data-parallel degree (:attr:`gem_model.layout.Layout.dp_degree`),
        not the number of processes: the ranks of one tensor- or context-parallel group read the same samples."""

    def bind_model(self, model: ModelConfig, spec: FeatureSpec) -> None:
        """Called once by the run before the first batch, with the run's ``ModelConfig`` and the
        source's ``FeatureSpec``: a cost-aware balancer reads its per-sample costs off the model here
        (``seq_balanced`` takes ``a``, ``b`` from :mod:`gem_model.model.flops`)."""
