"""Everything the multi-process tests run, in one start of the processes per world size."""

from __future__ import annotations

from typing import Any

import comm_dense_cases
import comm_embedding_cases
import comm_slowdown_cases


def run_all(rank: int, world: int) -> dict[str, Any]:
    out = {"train": comm_dense_cases.train(rank, world), "exact": comm_dense_cases.exact_gradients(rank, world)}
    if world == 2:
        out["default"] = comm_dense_cases.default_reductions(rank, world)
        out["embedding"] = comm_embedding_cases.run(rank, world)
        out["slowdown"] = comm_slowdown_cases.run(rank, world)
    return out
