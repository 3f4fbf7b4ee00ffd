"""``gem-train data convert movielens_1m``: the Parquet copy, read by the ``parquet`` source, trains like the original."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("pyarrow", reason="the parquet source needs pyarrow: pip install 'gem-model[parquet]'")
from movielens_cases import write_dataset

from gem_model.cli import main
from gem_model.config_io import load_config
from gem_model.data.convert import source_ref
from gem_model.data.movielens import MovieLensConfig, MovieLensSource
from gem_model.data.parquet import ParquetSource
from gem_model.data.parquet_schema import ParquetConfig

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
OPTIONS = ["side_features=true", "max_len=3", "num_negatives=4", "negatives_per=position", "actions=ratings"]


@pytest.fixture
def converted(tmp_path, capsys) -> tuple[Path, Path]:
    folder = write_dataset(tmp_path / "ml")
    out = tmp_path / "ml-parquet"
    args = ["data", "convert", "movielens_1m", str(out), f"data_dir={folder}", *OPTIONS, "--row-group-size", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "wrote 9 rows" in printed and "gem-train run -c" in printed  # 3 users: training, validation, test
    return folder, out


def _kjts_equal(a, b) -> bool:
    return a.keys() == b.keys() and torch.equal(a.values(), b.values()) and torch.equal(a.lengths(), b.lengths())


def test_the_copy_gives_the_same_batches(converted):
    folder, out = converted
    ref = source_ref(out)
    assert ref["name"] == "parquet"
    copy = ParquetSource(ParquetConfig(**ref["options"]))
    assert len(copy.groups) == 2  # 3 users in row groups of 2
    options = {k: yaml.safe_load(v) for k, v in (o.split("=") for o in OPTIONS)}
    original = MovieLensSource(MovieLensConfig(data_dir=str(folder), **options))
    assert copy.feature_spec() == original.feature_spec()
    for step in range(4):
        assert torch.equal(copy.lengths(step, 4), original.lengths(step, 4))
        for indices in (torch.arange(4), torch.tensor([3, 0])):
            a, b = copy.make_batch(step, 4, indices), original.make_batch(step, 4, indices)
            assert _kjts_equal(a.sequence, b.sequence) and _kjts_equal(a.pooled, b.pooled)
            for name in ("dense", "labels", "sample_ids", "timestamps", "request_times"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_training_from_the_copy_gives_the_same_losses(pm, tiny_overrides, tmp_path, capsys):
    """ml1m-gem.yaml shrunk (inline kernels, one block, batch 16, histories of 15), with the time bias on."""
    from gem_model.trainer import train

    folder = write_dataset(tmp_path / "ml")
    options = {"data_dir": str(folder), "max_len": 15, "num_negatives": 4, "negatives_per": "position", "side_features": True}
    out = tmp_path / "ml-parquet"
    assert main(["data", "convert", "movielens_1m", str(out), *(f"{k}={v}" for k, v in options.items())]) == 0
    small = [*tiny_overrides, "trainer.device=cpu", "trainer.steps=4", "trainer.eval_at_end=false", "model.relative_time_bias=true"]
    losses = {}
    for name, source in (("original", {"name": "movielens_1m", "options": options}), ("copy", source_ref(out))):
        config = yaml.safe_load((CONFIGS / "ml1m-gem.yaml").read_text())
        config["name"], config["data"]["source"] = name, source
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        train(load_config(str(tmp_path / f"{name}.yaml"), small), pm)
        records = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["step_loss"] for r in records if "step_loss" in r]
    assert len(losses["original"]) == 4
    assert losses["copy"] == losses["original"]  # the same batches, bit for bit: the same losses
