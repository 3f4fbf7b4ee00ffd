"""Parquet end to end: `gem-train data convert` writes a run that trains and evaluates as it is, the
copy evaluates as the built-in source does, what the data lacks is refused before training, and the
reader checks each event's time against its request time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("pyarrow", reason="the parquet source needs pyarrow: pip install 'gem-model[parquet]'")
from movielens_cases import write_dataset
from parquet_cases import options, rows, write

from gem_model import testing
from gem_model.cli import main
from gem_model.config_io import load_config
from gem_model.data.convert import RUN_FILE, source_ref
from gem_model.data.parquet import ParquetSource
from gem_model.data.parquet_schema import ParquetConfig, ParquetDataError
from gem_model.trainer import train

SMALL = ["max_len=15", "num_negatives=4", "negatives_per=position", "side_features=true", "eval_batch_size=2"]


@pytest.fixture
def converted(tmp_path) -> tuple[Path, Path]:
    folder = write_dataset(tmp_path / "ml")
    out = tmp_path / "ml-parquet"
    assert main(["data", "convert", "movielens_1m", str(out), f"data_dir={folder}", *SMALL, "--row-group-size", "2"]) == 0
    return folder, out


def test_the_written_run_config_trains_and_evaluates_as_it_is(converted, tmp_path, monkeypatch, capsys):
    _, out = converted
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    run = yaml.safe_load((out / RUN_FILE).read_text())
    assert run["data"]["source"] == source_ref(out) and run["model"]["use_candidate"] is False
    # the core alone has no kernels or schemes: the inline ones stand in; the data part is as written
    argv = ["run", "-c", str(out / RUN_FILE), *testing.INLINE_COMPONENTS, "trainer.steps=2",
            f"trainer.output_dir={tmp_path}/run", "trainer.eval_at_end=true"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = records[-1]
    assert {"valid/hr@10", "valid/ndcg@10", "test/hr@10", "test/ndcg@10", "valid/hr@10_unfiltered"} <= set(final)


def test_the_copy_evaluates_as_the_original_does(converted, pm, tiny_overrides, tmp_path):
    folder, out = converted
    options_ = {k: yaml.safe_load(v) for k, v in (o.split("=") for o in SMALL)} | {"data_dir": str(folder)}
    small = [*tiny_overrides, "trainer.steps=2", "trainer.eval_at_end=true", "model.use_candidate=false",
             "model.relative_time_bias=true"]  # fmt: skip
    metrics = {}
    for name, source in (("original", {"name": "movielens_1m", "options": options_}), ("copy", source_ref(out))):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({"name": name, "data": {"source": source}}))
        summary = train(load_config(str(tmp_path / f"{name}.yaml"), small), pm)
        metrics[name] = summary.extra["eval"]
    assert set(metrics["original"]) == {f"{s}/{m}@{k}{u}" for s in ("valid", "test") for m in ("hr", "ndcg")
                                        for k in (10, 50) for u in ("", "_unfiltered")}  # fmt: skip
    assert metrics["copy"] == pytest.approx(metrics["original"], rel=1e-6, abs=1e-9)


def test_without_a_candidate_column_use_candidate_is_refused_before_training(converted, tmp_path, monkeypatch, capsys):
    _, out = converted
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    argv = ["run", "-c", str(out / RUN_FILE), *testing.INLINE_COMPONENTS, "model.use_candidate=true",
            f"trainer.output_dir={tmp_path}/run"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "model.use_candidate: data.source 'parquet' gives no candidate item per sample" in err
    assert "data.source.options.columns.candidate" in err
    assert not (tmp_path / "run").exists()


def test_an_evaluation_file_without_its_target_column_is_refused_when_the_source_is_built(tmp_path):
    path = write(tmp_path / "train.parquet", rows(8))
    with pytest.raises(ParquetDataError, match=r"column 'target' \(evaluation.target of the valid split"):
        ParquetSource(ParquetConfig(**options(path, evaluation={"valid": str(path)})))


def test_an_event_after_its_request_time_is_refused_naming_the_row(tmp_path):
    records = rows(16)
    records[11]["history_time"][1] = 6_500_000_000_000_000_000  # the impossible timestamp
    src = ParquetSource(ParquetConfig(**options(write(tmp_path / "t.parquet", records), shuffle="none")))
    src.make_batch(0, 8, torch.arange(8))  # the first row group is fine
    with pytest.raises(ParquetDataError, match=r"t\.parquet, row group 1, column 'history_time', row 3 \(row 11 of the "
                       r"data\): time 6500000000000000000 is after the row's request time 1150 \(column 'request_time'\)"):  # fmt: skip
        src.make_batch(1, 8, torch.arange(8))

