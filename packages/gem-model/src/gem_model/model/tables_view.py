"""What planners and the precision layer see of the gem model's tables: the methods of
:class:`gem_model.protocols.ShardableModel`, for a module whose torchrec collections live in its
``sparse`` (:class:`~gem_model.model.embeddings.SparseArch`); everything else of the module is dense."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gem_model.data.batch import Batch
from gem_model.model.embeddings import SparseArch
from gem_model.model.lookup_bags import even_bags


class ShardableTables(nn.Module):
    """An ``nn.Module`` whose tables live in ``sparse`` (``seed``: their initialisation's), with the
    protocol's table methods, each answered by ``sparse``. The subclass sets both in its ``__init__``."""

    sparse: SparseArch
    seed: int

    def table_modules(self) -> dict[str, nn.Module]:
        out: dict[str, nn.Module] = {"sparse.ec": self.sparse.ec}
        if self.sparse.ebc is not None:
            out["sparse.ebc"] = self.sparse.ebc
        return out

    def table_inputs(self) -> dict[str, str]:
        sequence = "sequence" if self.sparse.lookup_bags_per_sample is None else "lookup_sequence"
        return {"sparse.ec": sequence, **({"sparse.ebc": "pooled"} if self.sparse.ebc is not None else {})}

    def prepare_table_inputs(self, batch: Batch) -> None:
        """Attach to ``batch`` the inputs :meth:`table_inputs` names beyond its own fields: the sequence
        in even bags (``batch.lookup_sequence``), built on the current stream."""
        bags = self.sparse.lookup_bags_per_sample
        if bags is not None:
            batch.lookup_sequence = even_bags(batch.sequence, bags)

    def table_configs(self) -> list[Any]:
        configs: list[Any] = list(self.sparse.ec.embedding_configs())
        if self.sparse.ebc is not None:
            configs += self.sparse.ebc.embedding_bag_configs()
        return configs

    def table_state_dict(self) -> dict[str, torch.Tensor]:
        return {f"sparse.{k}": v for k, v in self.sparse.state_dict().items()}

    def dense_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.named_parameters() if not n.startswith("sparse.")]

    @property
    def tables_on_meta(self) -> bool:
        return self.sparse.on_meta

    def materialize_tables(self, device: torch.device) -> None:
        self.sparse.materialize_on(device, self.seed)

    def set_table_grad_scale(self, scale: float) -> None:
        self.sparse.grad_scale = scale

    def set_table_grad_gate(self, gate: Callable[[], None] | None) -> None:
        self.sparse.grad_gate = gate
