"""Checkpoint integrity: a manifest written last; a damaged, truncated or partial checkpoint is
reported by file and skipped, and the run resumes from the newest one that verifies."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from gem_model.config_io import load_config
from gem_model.errors import CheckpointError
from gem_model.train.integrity import verify
from gem_model.trainer import train


def step_losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["step_loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


def shard(path: Path) -> Path:
    return next(path.glob("*.distcp"))


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


# how the newest checkpoint is broken -> what the report says about which file
DAMAGE = {
    "corrupted shard": (lambda c: flip_a_byte(shard(c)), r"__0_0.distcp: its SHA-256 differs from the manifest's"),
    "truncated shard": (lambda c: truncate(shard(c)), r"__0_0.distcp: \d+ bytes, the manifest says \d+"),
    "damaged metadata": (lambda c: flip_a_byte(c / ".metadata"), r".metadata: its SHA-256 differs"),
    "missing meta.json": (lambda c: (c / "meta.json").unlink(), r"meta.json: missing"),
    "no manifest (partial save)": (lambda c: (c / "manifest.json").unlink(), r"manifest.json: missing"),
    "unreadable manifest": (lambda c: (c / "manifest.json").write_text("{"), r"manifest.json: unreadable"),
}


@pytest.fixture
def two_checkpoints(pm, tiny_overrides, tmp_path):
    """A run of 4 steps with checkpoints at 2 and 4, and its config."""
    cfg = load_config(None, [*tiny_overrides, "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.eval_at_end=false"])
    train(cfg, pm)
    return cfg, tmp_path / "gem-tiny"


def test_every_file_of_a_checkpoint_is_in_its_manifest_with_its_checksum(two_checkpoints):
    _, out = two_checkpoints
    ckpt = out / "checkpoints" / "step_00000004"
    files = json.loads((ckpt / "manifest.json").read_text())["files"]
    on_disk = {str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(files) == on_disk and {"meta.json", "plan.json", ".metadata"} <= on_disk
    for name, entry in files.items():
        data = (ckpt / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert verify(ckpt) == []


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_broken_checkpoint_is_reported_by_file_and_the_previous_one_resumes(pm, two_checkpoints, capsys, kind):
    cfg, out = two_checkpoints
    before = step_losses(out)
    damage, report = DAMAGE[kind]
    damage(out / "checkpoints" / "step_00000004")
    capsys.readouterr()
    train(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"steps": 4})}), pm)
    said = capsys.readouterr().out
    assert "skipped checkpoint" in said and "step_00000004" in said
    assert re.search(report, said), said
    assert f"falling back to {out / 'checkpoints' / 'step_00000002'}" in said
    assert "continuing from" in said and "(step 2 of 4)" in said
    assert step_losses(out) == before  # steps 3 and 4 again, bitwise, from the valid checkpoint


def test_no_valid_checkpoint_stops_naming_each_one_and_loads_nothing(pm, two_checkpoints):
    cfg, out = two_checkpoints
    flip_a_byte(shard(out / "checkpoints" / "step_00000004"))
    truncate(shard(out / "checkpoints" / "step_00000002"))
    with pytest.raises(CheckpointError, match="none verifies") as info:
        train(cfg, pm)
    assert "step_00000004: __0_0.distcp: its SHA-256" in str(info.value)
    assert "step_00000002: __0_0.distcp:" in str(info.value) and "truncated" in str(info.value)


def test_an_unfinished_save_is_never_a_resume_point(pm, two_checkpoints, capsys):
    """A kill during a save leaves ``step_N.partial``: ignored, and the previous checkpoint stays valid."""
    cfg, out = two_checkpoints
    root = out / "checkpoints"
    shutil.copytree(root / "step_00000004", root / "step_00000006.partial")
    (root / "step_00000006.partial" / "manifest.json").unlink()
    capsys.readouterr()
    train(cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"steps": 6})}), pm)
    said = capsys.readouterr().out
    assert f"continuing from {root / 'step_00000004'} (step 4 of 6)" in said and "skipped" not in said
    assert verify(root / "step_00000006") == [] and not (root / "step_00000006.partial").exists()
