"""What a parallel planner may know of the run it lays out, before any process starts.

The core binds it to the run's planner once (:meth:`ParallelPlanner.bind_run
<gem_model.components.ParallelPlanner.bind_run>`), before asking for the degrees. A planner that
only reads its own options ignores it; one that searches for degrees (gem-parallel's ``auto``) reads
the model's sizes and the data's lengths here. Both are built on first use only: the model on the
meta device (no memory, so tables of tens of GB cost nothing), the lengths from the data source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from gem_model.config import RunConfig
    from gem_model.data.batch import FeatureSpec
    from gem_model.protocols import ShardableModel


@dataclass
class RunShape:
    """The run a planner lays out: its validated config, how many ranks share a node, the model's
    parts and the data's sequence lengths.

    ``ranks_per_node``: processes per node (``--nproc``, or torchrun's ``LOCAL_WORLD_SIZE``); None
    where nobody said (``gem-train plan`` without ``--gpus-per-node``)."""

    config: RunConfig
    ranks_per_node: int | None = None
    build_model: Callable[[], ShardableModel] | None = field(default=None, repr=False)
    read_lengths: Callable[[int], torch.Tensor] | None = field(default=None, repr=False)
    feature_spec: FeatureSpec | None = field(default=None, repr=False)
    activation_dtype: torch.dtype | None = None
    """The dtype activations flow in (``precision.activation_dtype``, ``auto`` resolved through the scheme)."""
    _model: ShardableModel | None = field(default=None, init=False, repr=False)

    @property
    def num_heads(self) -> int:
        return self.config.model.num_heads

    @property
    def global_batch_size(self) -> int:
        return self.config.data.global_batch_size

    @property
    def max_seq_len(self) -> int:
        return self.config.model.max_seq_len

    def model(self) -> ShardableModel:
        """The run's model on the meta device: its tables (:meth:`ShardableModel.table_configs`), its
        blocks and dense parameters, with no memory behind them. Built once."""
        if self._model is None:
            if self.build_model is None:
                raise ValueError("this RunShape was made without a model (gem_model.resolve.run_shape builds one)")
            self._model = self.build_model()
        return self._model

    def history_lengths(self, batches: int = 8) -> torch.Tensor:
        """The history lengths of the data source's first ``batches`` global batches (int64)."""
        if self.read_lengths is None:
            raise ValueError("this RunShape was made without a data source (gem_model.resolve.run_shape reads one)")
        return self.read_lengths(batches)
