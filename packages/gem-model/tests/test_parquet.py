"""The ``parquet`` source: what it reads, in which order, on which rank, and what it refuses (and where)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
import torch

pytest.importorskip("pyarrow", reason="the parquet source needs pyarrow: pip install 'gem-model[parquet]'")
from parquet_cases import NUM_ITEMS, options, rows, write
from pydantic import ValidationError

from gem_model.components import LoadBalancer
from gem_model.data.balance import RoundRobinBalancer
from gem_model.data.loader import ShardedLoader
from gem_model.data.parquet import ParquetSource
from gem_model.data.parquet_schema import ParquetConfig, ParquetDataError
from gem_model.data.prefetch import PrefetchLoader
from gem_model.data.validation import validate_batch


def source(path: Path | str, **overrides) -> ParquetSource:
    return ParquetSource(ParquetConfig(**options(path, **overrides)))


@pytest.fixture
def two_files(tmp_path) -> Path:
    """40 rows in two files (24 + 16) of row groups of 8."""
    write(tmp_path / "data" / "part-0.parquet", rows(24))
    write(tmp_path / "data" / "part-1.parquet", rows(16, start=24))
    return tmp_path / "data"


def histories(batch) -> list[list[int]]:
    jt = batch.sequence["seq_item"]
    return [t.tolist() for t in jt.values().split(jt.lengths().tolist())]


def test_registered_and_builds_from_its_config(pm, two_files):
    cls = pm.data_sources.get("parquet").cls
    src = cls(cls.Config(**options(two_files)))
    assert src.num_rows == 40 and len(src.groups) == 5 and len(src.files) == 2
    spec = src.feature_spec()
    assert (spec.num_items, spec.num_actions, spec.num_dense, spec.tasks) == (NUM_ITEMS, 4, 2, ("click",))
    assert [(p.name, p.num_embeddings, p.pooling) for p in spec.pooled] == [("user", 10, "sum"), ("tags", 4, "mean")]
    with pytest.raises(ValidationError, match="extra"):
        ParquetConfig(**options(two_files), colums={})
    with pytest.raises(ValidationError, match="both be set"):
        ParquetConfig(**options(two_files, columns={"history_time": None}))


def test_reads_every_role_in_file_order_and_keeps_the_most_recent_events(two_files):
    src = source(two_files, shuffle="none")
    assert src.steps_per_epoch(16) == 3
    batch = src.make_batch(1, 16, torch.arange(16))  # rows 16..31, across both files
    validate_batch(batch, src.feature_spec())
    expect = [[(r + j) % NUM_ITEMS for j in range(r % 7)][-5:] for r in range(16, 32)]
    assert histories(batch) == expect
    assert batch.sample_ids.tolist() == list(range(16, 32))
    assert batch.timestamps[:2].tolist() == [1600, 1601]  # row 16: 2 events
    assert batch.sequence["seq_action"].values()[:2].tolist() == [1, 2]
    assert batch.request_times.tolist() == [100 * x + 50 for x in range(16, 32)]
    assert batch.sequence["cand_item"].values().tolist() == [(3 * x) % NUM_ITEMS for x in range(16, 32)]
    assert batch.pooled["user"].values().tolist() == [x % 10 for x in range(16, 32)]
    assert batch.pooled["tags"].lengths().tolist() == [x % 3 for x in range(16, 32)]
    assert torch.allclose(batch.dense[:, 0], torch.arange(16, 32) / 10.0)
    assert batch.labels[:, 0].tolist() == [float(x % 2) for x in range(16, 32)]
    assert batch.sequence["neg_item"].lengths().tolist() == [3] * 16
    # the last batch of the epoch wraps around to its first rows
    assert src.rows_of_step(2, 16).tolist() == [*range(32, 40), *range(8)]


@pytest.mark.parametrize("shuffle", ["rows", "row_groups"])
def test_each_epoch_is_a_seeded_permutation(two_files, shuffle):
    src = source(two_files, shuffle=shuffle, seed=1, shuffle_window=1)
    epochs = [torch.cat([src.rows_of_step(s, 8) for s in range(5 * e, 5 * e + 5)]) for e in range(2)]
    assert all(sorted(e.tolist()) == list(range(40)) for e in epochs) and not torch.equal(*epochs)
    assert torch.equal(epochs[0], source(two_files, shuffle=shuffle, seed=1, shuffle_window=1).rows_of_step(0, 40))
    if shuffle == "row_groups":  # a window of one row group of 8: each step reads one row group
        assert all(len(set((src.rows_of_step(s, 8) // 8).tolist())) == 1 for s in range(5))


def test_every_step_is_a_pure_function_of_the_step(two_files):
    a, b = source(two_files, seed=3), source(two_files, seed=3)
    order = [a.rows_of_step(s, 16) for s in range(6)]
    assert sorted(torch.cat(order[:3])[:40].tolist()) == list(range(40))  # one epoch is a permutation
    assert any(not torch.equal(order[s], order[s + 3]) for s in range(3))  # the next one another
    for step in (4, 0, 4):  # any order of asking
        x, y = a.make_batch(step, 16, torch.arange(16)), b.make_batch(step, 16, torch.arange(16))
        assert histories(x) == histories(y)
        assert torch.equal(x.sequence.values(), y.sequence.values())
    other = source(two_files, seed=4)
    assert any(not torch.equal(a.rows_of_step(s, 16), other.rows_of_step(s, 16)) for s in range(3))


def test_a_resumed_loader_continues_exactly(two_files):
    whole = ShardedLoader(source(two_files), RoundRobinBalancer(), global_batch_size=8)
    seen = [histories(next(whole)) for _ in range(6)]
    resumed = ShardedLoader(source(two_files), RoundRobinBalancer(), global_batch_size=8)
    resumed.load_state_dict({"step": 3, "global_batch_size": 8})
    assert [histories(next(resumed)) for _ in range(3)] == seen[3:]


class HalvesBalancer(LoadBalancer):
    """Rank r gets the r-th contiguous block of the global batch."""

    name: ClassVar[str] = "halves"

    def assign(self, lengths, world_size):
        return list(torch.arange(lengths.numel()).chunk(world_size))


def test_ranks_read_lengths_first_then_only_their_own_rows(two_files):
    single = source(two_files, shuffle="none").make_batch(0, 16, torch.arange(16))
    shares = []
    for rank in range(2):
        src = source(two_files, shuffle="none", columns={"candidate": "candidate", "history_length": "history_length"})
        lengths = src.lengths(0, 16)
        assert src.row_groups_read == 0 and lengths.tolist() == [min(r % 7, 5) for r in range(16)]
        loader = ShardedLoader(src, HalvesBalancer(), global_batch_size=16, rank=rank, world_size=2)
        shares.append(histories(loader.batch_at(0)))
        assert src.row_groups_read == 1  # rows 8 r .. 8 r + 7: one row group of 8
    assert shares[0] + shares[1] == histories(single)
    # round robin: each rank gets every other sample, the union is the batch
    rr = [ShardedLoader(source(two_files), RoundRobinBalancer(), global_batch_size=16, rank=r, world_size=2).batch_at(5) for r in range(2)]
    assert sorted(torch.cat([b.sample_ids for b in rr]).tolist()) == list(range(80, 96))


# ------------------------------------------------------------------------------------------ errors


def test_missing_columns_and_wrong_types_name_the_file_and_column(tmp_path):
    path = write(tmp_path / "a.parquet", rows(8))
    with pytest.raises(ParquetDataError, match=r"a\.parquet: column 'nope' \(a dense feature.*is missing"):
        source(path, dense=["age", "nope"])
    with pytest.raises(ParquetDataError, match=r"a\.parquet: column 'user' \(columns.history_item\) has type int32 \(integer\); expected list<integer>"):
        source(path, columns={"history_item": "user"})
    with pytest.raises(ParquetDataError, match=r"column 'extra' \(a dense feature\) has type string"):
        source(path, dense=["extra"])


@pytest.mark.parametrize(
    ("change", "overrides", "message"),
    [
        ("history_item", {}, r"row group 1, column 'history_item', row 3 \(row 11 of the data\): id 50 is outside \[0, 49\]"),
        ("user", {}, r"row group 1, column 'user', row 3 \(row 11 of the data\): id 50 is outside \[0, 9\]"),
        ("history_action", {}, r"row group 1, column 'history_action', row 3 \(row 11 of the data\): 1 values, but the history has 4"),
        ("click", {}, r"row group 1, column 'click', row 3 \(row 11 of the data\): value 2.0 is not a label in \[0, 1\]"),
        ("age", {}, r"row group 1, column 'age', row 3 \(row 11 of the data\): value nan is not a finite number"),
        ("null", {}, r"row group 1, column 'request_time', row 3 \(row 11 of the data\): null"),
    ],
)
def test_bad_values_name_file_row_group_column_and_row(tmp_path, change, overrides, message):
    records = rows(16)
    bad = records[11]
    if change in ("history_item", "user"):
        bad[change] = [50, *bad[change][1:]] if change == "history_item" else 50
    elif change == "history_action":
        bad["history_action"] = [1]
    elif change == "click":
        bad["click"] = 2.0
    elif change == "age":
        bad["age"] = float("nan")
    else:
        bad["request_time"] = None
    src = source(write(tmp_path / "b.parquet", records), shuffle="none", **overrides)
    src.make_batch(0, 8, torch.arange(8))  # the first row group is fine
    with pytest.raises(ParquetDataError, match=r"b\.parquet, " + message):
        src.make_batch(1, 8, torch.arange(8))


def test_a_bad_file_is_an_error_naming_it_never_a_crash(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(ParquetDataError, match=r"junk\.parquet: not a readable Parquet file"):
        source(junk)
    good = write(tmp_path / "good.parquet", rows(16), row_group_size=16)
    data = bytearray(good.read_bytes())
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(ParquetDataError, match=r"cut\.parquet: not a readable Parquet file"):
        source(cut)
    # flip bytes inside the first data page: the page checksum catches it when the row group is read
    src = source(good)
    start = src._handles[0].metadata.row_group(0).column(0).data_page_offset
    for i in range(start + 20, start + 40):
        data[i] ^= 0xFF
    broken = tmp_path / "broken.parquet"
    broken.write_bytes(bytes(data))
    src = source(broken, shuffle="none")
    with pytest.raises(ParquetDataError, match=r"broken\.parquet, row group 0, column 'history_item': cannot be read"):
        src.make_batch(0, 8, torch.arange(8))


def test_an_error_in_the_prefetch_thread_reaches_the_step_that_needs_it(tmp_path):
    records = rows(16)
    records[12]["user"] = 99
    src = source(write(tmp_path / "c.parquet", records), shuffle="none")
    with PrefetchLoader(ShardedLoader(src, RoundRobinBalancer(), global_batch_size=8), depth=2) as feed:
        feed.get(0)
        with pytest.raises(ParquetDataError, match=r"row group 1, column 'user', row 4 \(row 12 of the data\): id 99"):
            feed.get(1)


def test_no_files_and_no_pyarrow_are_clear_errors(tmp_path, monkeypatch):
    with pytest.raises(ParquetDataError, match="names no Parquet file"):
        source(tmp_path / "nothing-*.parquet")
    monkeypatch.setitem(__import__("sys").modules, "pyarrow", None)
    with pytest.raises(ParquetDataError, match=r"needs pyarrow.*gem-model\[parquet\]"):
        source(tmp_path)
