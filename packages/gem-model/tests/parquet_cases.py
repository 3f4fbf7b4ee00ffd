"""Small Parquet files with every column role, shared by the parquet tests (not a test module)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pa = pytest.importorskip("pyarrow", reason="the parquet source needs pyarrow: pip install 'gem-model[parquet]'")
import pyarrow.parquet as pq  # noqa: E402

NUM_ITEMS = 50


def rows(n: int, start: int = 0) -> list[dict[str, Any]]:
    """Row ``r`` has a history of ``r % 7`` events: items ``(r + j) % 50``, actions ``1 + j % 3``, times ``100 r + j``."""
    out = []
    for r in range(start, start + n):
        length = r % 7
        out.append(
            {
                "history_item": [(r + j) % NUM_ITEMS for j in range(length)],
                "history_action": [1 + j % 3 for j in range(length)],
                "history_time": [100 * r + j for j in range(length)],
                "history_length": length,
                "request_time": 100 * r + 50,
                "candidate": (3 * r) % NUM_ITEMS,
                "user": r % 10,
                "tags": [r % 4] * (r % 3),
                "age": float(r) / 10.0,
                "score": -float(r),
                "click": float(r % 2),
                "extra": "ignored",
            }
        )
    return out


SCHEMA = pa.schema(
    [
        ("history_item", pa.list_(pa.int32())),
        ("history_action", pa.list_(pa.int8())),
        ("history_time", pa.list_(pa.int64())),
        ("history_length", pa.int32()),
        ("request_time", pa.int64()),
        ("candidate", pa.int64()),
        ("user", pa.int32()),
        ("tags", pa.list_(pa.int64())),
        ("age", pa.float32()),
        ("score", pa.float64()),
        ("click", pa.float32()),
        ("extra", pa.string()),
    ]
)


def write(path: Path, records: list[dict[str, Any]], *, row_group_size: int = 8, schema: Any = SCHEMA) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path, row_group_size=row_group_size, write_page_checksum=True)
    return path


def options(path: Path | str, **overrides: Any) -> dict[str, Any]:
    """Source options that map every column of :data:`SCHEMA`."""
    out: dict[str, Any] = {
        "path": str(path),
        "num_items": NUM_ITEMS,
        "num_actions": 4,
        "max_len": 5,
        "num_negatives": 3,
        "columns": {"candidate": "candidate"},
        "pooled": [
            {"feature": "user", "column": "user", "num_embeddings": 10},
            {"feature": "tags", "column": "tags", "num_embeddings": 4, "pooling": "mean"},
        ],
        "dense": ["age", "score"],
        "labels": [{"task": "click", "column": "click"}],
    }
    out.update(overrides)
    return out
