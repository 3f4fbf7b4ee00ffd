"""``trainer.tensorboard``: the metrics as TensorBoard scalars beside metrics.jsonl, read back from the event file."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from gem_model.config_io import load_config
from gem_model.train.tensorboard import TensorBoardUnavailableError, TensorBoardWriter

needs_tensorboard = pytest.mark.skipif(
    importlib.util.find_spec("tensorboard") is None,
    reason="trainer.tensorboard needs the tensorboard package: pip install 'gem-model[tensorboard]'",
)


@needs_tensorboard
def test_scalars_of_steps_and_evaluations_are_read_back(pm, tiny_overrides, tmp_path, source):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gem_model.trainer import train

    source()  # writes the hand-made MovieLens files
    cfg = load_config(
        None,
        [
            *tiny_overrides,
            "trainer.device=cpu",
            "trainer.steps=3",
            "trainer.tensorboard=true",
            "model.use_candidate=false",
            "data.source=movielens_1m",
            f"data.source.options.data_dir={tmp_path / 'ml'}",
            "data.source.options.max_len=15",
            "data.source.options.num_negatives=4",
        ],
    )
    train(cfg, pm)
    out = tmp_path / cfg.name
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    events = list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    for key in ("loss", "next_item_loss", "task_loss", "tokens_per_s", "samples_per_s", "mfu", "step_seconds"):
        assert f"train/{key}" in tags
        logged = [(r["step"], r[key]) for r in records if key in r]
        assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars(f"train/{key}")] == logged
    assert "memory/max_rss_gib" in tags and all(e.value > 0 for e in acc.Scalars("memory/max_rss_gib"))
    final = records[-1]
    for key in ("valid/hr@10", "test/ndcg@50"):
        assert [(e.step, pytest.approx(e.value, rel=1e-6)) for e in acc.Scalars(key)] == [(final["step"], final[key])]


def test_without_tensorboard_the_option_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(TensorBoardUnavailableError, match=r"gem-model\[tensorboard\].*trainer.tensorboard=false"):
        TensorBoardWriter(tmp_path / "tb")
