"""A second run in the same output directory: continues this run, refuses another run's checkpoints."""

from __future__ import annotations

import builtins
import json
from pathlib import Path

import pytest

from gem_model.config_io import load_config
from gem_model.errors import CheckpointError
from gem_model.train.identity import differences
from gem_model.trainer import train


def losses(output_dir: Path) -> list[float]:
    return [json.loads(line)["step_loss"] for line in (output_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoints(output_dir: Path) -> list[str]:
    return sorted(p.name for p in (output_dir / "checkpoints").iterdir())


def test_the_same_run_twice_trains_nothing_the_second_time(pm, tiny_overrides, tmp_path, capsys):
    cfg = load_config(None, tiny_overrides)
    train(cfg, pm)
    before = losses(tmp_path / "gem-tiny")
    capsys.readouterr()
    summary = train(cfg, pm)
    out = capsys.readouterr().out
    assert "nothing to train" in out and "step 6 of trainer.steps=6" in out
    assert summary.steps == 6
    assert losses(tmp_path / "gem-tiny") == before  # nothing trained, nothing lost
    assert checkpoints(tmp_path / "gem-tiny") == ["step_00000006"]


def test_a_longer_second_run_continues_with_identical_losses(pm, tiny_overrides, tmp_path, capsys):
    """trainer.resume left unset (auto): steps and logging may change, the run continues exactly."""
    train(load_config(None, [*tiny_overrides, f"trainer.output_dir={tmp_path}/a", "trainer.steps=6"]), pm)
    train(load_config(None, [*tiny_overrides, f"trainer.output_dir={tmp_path}/b", "trainer.steps=3"]), pm)
    capsys.readouterr()
    again = [*tiny_overrides, f"trainer.output_dir={tmp_path}/b", "trainer.steps=6", "trainer.eval_at_end=false"]
    train(load_config(None, again), pm)
    assert "continuing from" in capsys.readouterr().out
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert len(b) == 6 and a == b  # bit-identical to the uninterrupted run
    assert checkpoints(tmp_path / "b") == ["step_00000003", "step_00000006"]


def test_another_runs_checkpoints_are_refused_naming_the_field(pm, tiny_overrides, tmp_path):
    train(load_config(None, [*tiny_overrides, "trainer.steps=2"]), pm)
    before = checkpoints(tmp_path / "gem-tiny")
    other = [*tiny_overrides, "trainer.steps=4", "model.embedding_dim=16", "trainer.sparse_optimizer=adam"]
    with pytest.raises(CheckpointError, match="another run") as info:
        train(load_config(None, other), pm)
    message = str(info.value)
    assert (
        "model.embedding_dim (32 -> 16)" in message
        and 'trainer.sparse_optimizer ("rowwise_adagrad" -> "adam")' in message
    )
    assert "trainer.steps" not in message
    assert checkpoints(tmp_path / "gem-tiny") == before


def test_resume_false_refuses_any_checkpoint(pm, tiny_overrides, tmp_path):
    train(load_config(None, [*tiny_overrides, "trainer.steps=2"]), pm)
    with pytest.raises(CheckpointError, match="trainer.resume=false"):
        train(load_config(None, [*tiny_overrides, "trainer.steps=2", "trainer.resume=false"]), pm)


def test_resume_defaults_to_auto():
    assert load_config(None, []).trainer.resume is None
    assert load_config(None, ["trainer.resume=false"]).trainer.resume is False


def test_only_fields_that_shape_the_run_make_it_another_run(pm):
    base = load_config(None, []).model_dump(mode="json")
    same = load_config(
        None,
        [
            "trainer.steps=999",
            "trainer.log_every=3",
            "trainer.output_dir=/elsewhere",
            "trainer.progress=false",
            "trainer.time_limit_s=5",
            "trainer.eval_every=2",
            "trainer.eval_at_end=false",
            "trainer.resume=true",
            "trainer.checkpoint_every=4",
            "trainer.prefetch=0",
        ],
    ).model_dump(mode="json")
    assert differences(base, same, pm) == []
    other = load_config(None, ["data.global_batch_size=32", "trainer.seed=1", "name=x"]).model_dump(mode="json")
    assert differences(base, other, pm) == [
        "data.global_batch_size (64 -> 32)",
        'name ("gem-tiny" -> "x")',
        "trainer.seed (0 -> 1)",
    ]


def test_a_broken_fbgemm_gpu_names_the_fix(monkeypatch, capsys):
    from gem_model import cli
    from gem_model._deps import TorchrecImportError, import_torchrec

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "torchrec" or name.startswith("torchrec."):
            raise OSError("libcudart.so.12: cannot open shared object file: No such file or directory")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with pytest.raises(TorchrecImportError, match="torchrec could not load fbgemm-gpu: libcudart.so.12") as info:
        import_torchrec()
    assert (
        "pip uninstall -y fbgemm-gpu && pip install fbgemm-gpu-cpu==1.8.0 && pip install --no-deps torchrec==1.8.0"
        in str(info.value)
    )
    assert isinstance(info.value, ImportError)
    assert cli.main(["plugins"]) == 1
    assert "torchrec could not load fbgemm-gpu" in capsys.readouterr().err
