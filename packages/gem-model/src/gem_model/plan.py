"""A parallel plan as plain data: the layout's degrees and where every table and dense module goes.

:meth:`ParallelPlanner.plan <gem_model.components.ParallelPlanner.plan>` returns one, before
anything is wrapped; ``gem-train plan -c CONFIG`` prints it; the trainer writes it as ``plan.json``
beside each checkpoint; :meth:`ParallelPlanner.apply <gem_model.components.ParallelPlanner.apply>`
then wraps the model to match it. As TorchRec keeps ``ShardingPlan`` apart from DMP.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TablePlacement:
    """One embedding table: how it is split and which ranks hold it."""

    sharding: str
    """``unsharded``, ``table_wise``, ``row_wise``, ``column_wise``, ``table_row_wise``, ``data_parallel``..."""
    ranks: list[int]
    compute_kernel: str = ""
    rows: int = 0
    dim: int = 0


@dataclass(frozen=True)
class DensePlacement:
    """One dense module (a top-level child of the model): how its parameters are held."""

    strategy: str
    """``local`` (one process), ``replicated`` (DDP), ``fully_sharded``, ``tensor_parallel``..."""
    dims: list[str] = field(default_factory=list)
    """The layout dims its gradients are reduced (or its parameters sharded) over."""
    parameters: int = 0


@dataclass(frozen=True)
class Plan:
    """What a planner decided. Plain data: printable, comparable, saved with every checkpoint.

    ``native`` may carry the planner's own object for :meth:`apply` (torchrec's ``ShardingPlan``);
    it is never saved or compared: a plan read back from JSON has it None.
    """

    planner: str
    layout: dict[str, Any]
    """:meth:`gem_model.layout.Layout.describe`: the dims and their degrees."""
    tables: dict[str, TablePlacement]
    dense: dict[str, DensePlacement]
    notes: list[str] = field(default_factory=list)
    prediction: dict[str, Any] = field(default_factory=dict)
    """What the planner predicts of a step on this layout (plain data, e.g. gem-parallel's ``auto``:
    the step's parts in seconds, tokens/s, the scaling efficiency); empty when it predicts nothing.
    The notes say it in words."""
    native: Any = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("native")
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        return cls(
            planner=data["planner"],
            layout=data["layout"],
            tables={k: TablePlacement(**v) for k, v in data["tables"].items()},
            dense={k: DensePlacement(**v) for k, v in data["dense"].items()},
            notes=list(data.get("notes", [])),
            prediction=dict(data.get("prediction", {})),
        )

    def format(self) -> str:
        """The plan as a table, one row per table and per dense module."""
        degrees = " x ".join(f"{d}={n}" for d, n in self.layout["degrees"].items())
        world = self.layout["world_size"]
        lines = [f"planner {self.planner}: {degrees} ({world} rank{'s' if world != 1 else ''})", "tables:"]
        for name, t in sorted(self.tables.items()):
            kernel = f", {t.compute_kernel}" if t.compute_kernel else ""
            lines.append(f"  {name:<24} {t.rows:>10} x {t.dim:<5} {t.sharding}{kernel} on ranks {t.ranks}")
        lines.append("dense modules:")
        for name, d in sorted(self.dense.items()):
            over = f" over {'+'.join(d.dims)}" if d.dims else ""
            lines.append(f"  {name:<24} {d.parameters:>10} params  {d.strategy}{over}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
