"""What the core needs from a model and from a stateful component, as protocols.

Planners and the precision layer meet the model through :class:`ShardableModel`, never through
attribute paths (``model.sparse.ec``), so a new model fits every planner by providing these
methods. Nothing here imports a concrete class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import nn


@runtime_checkable
class ShardableModel(Protocol):
    """An ``nn.Module`` that tells planners and the precision layer what it is made of.

    The embedding tables live in torchrec ``EmbeddingCollection`` / ``EmbeddingBagCollection``
    modules (:meth:`table_modules`); everything else is dense. The gem model
    (:class:`gem_model.model.gem.GemModel`) is one implementation.
    """

    def table_modules(self) -> dict[str, nn.Module]:
        """Module name (as in ``named_modules()``) -> the torchrec collection holding tables."""
        ...

    def table_inputs(self) -> dict[str, str]:
        """Module name (as in :meth:`table_modules`) -> the batch attribute its forward is called
        with, unchanged (a KJT of :class:`~gem_model.data.batch.Batch`). A train pipeline that starts
        a batch's embedding input distribution ahead of its forward (gem-comm's ``sparse_dist``)
        reads it there; torchrec would find it by fx-tracing the model, which the gem model's
        forward does not allow (it loops over the lookups' outputs and branches on tensor values).
        A model whose lookup takes an input derived from the batch (the gem model's sequence in even
        bags, ``batch.lookup_sequence``) names that attribute and also has ``prepare_table_inputs(batch)``,
        which such a pipeline calls first, on the stream of the input distribution, to attach it."""
        ...

    def table_configs(self) -> list[Any]:
        """torchrec ``EmbeddingConfig`` / ``EmbeddingBagConfig`` of every table (``name``,
        ``num_embeddings``, ``embedding_dim``), in a fixed order."""
        ...

    def table_state_dict(self) -> dict[str, torch.Tensor]:
        """The full (unsharded) table weights keyed by their names in the model's ``state_dict``."""
        ...

    def dense_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter that is not in a table, with its name, in ``named_parameters()`` order."""
        ...

    def activation_blocks(self) -> list[str]:
        """Names of the blocks an activation policy (checkpointing) wraps, and ``compile`` compiles."""
        ...

    @property
    def tables_on_meta(self) -> bool:
        """True when the tables were built on the meta device and the planner must draw them."""
        ...

    def materialize_tables(self, device: torch.device) -> None:
        """Draw meta-device tables on ``device`` (from the model's seed)."""
        ...

    def set_table_grad_scale(self, scale: float) -> None:
        """Multiply the tables' output gradients by ``scale`` (a planner whose all-to-all sums them)."""
        ...

    def set_table_grad_gate(self, gate: Callable[[], None] | None) -> None:
        """Call ``gate()`` in backward before any gradient reaches a table (its update is fused into the
        lookup's backward): where ``trainer.loss_check=before_tables`` refuses a non-finite loss's update."""
        ...

    def set_activation_dtype(self, dtype: torch.dtype) -> None:
        """The dtype activations flow in (:mod:`gem_model.precision`)."""
        ...

    @property
    def activation_dtype(self) -> torch.dtype:
        """The dtype set by :meth:`set_activation_dtype` (a planner maps it onto FSDP2's
        ``MixedPrecisionPolicy``)."""
        ...


@runtime_checkable
class Stateful(Protocol):
    """A component with state of its own (fp8 scale history, error feedback, balancer statistics).

    Any component (kernel, scheme, policy, comm strategy, planner, data source, balancer, train
    pipeline, callback) that has both methods is checkpointed under ``components.<registry>.<name>``
    and restored before the first step of a resumed run. Values should be tensors (or nested dicts
    of them): ``torch.distributed.checkpoint`` round-trips those in every layout.
    """

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
