"""Storage failures are named: an output directory that cannot be written is refused with exit 2
before the model is built; a checkpoint that fails to write (the disk fills) names the step, the
path, the cause and the free space, leaves no partial folder, and the checkpoints before it stay
the resume point."""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint.filesystem as dcp_filesystem

from gem_model import trainer
from gem_model.cli import main
from gem_model.train import storage
from gem_model.train.integrity import verify


@pytest.fixture
def inline_env(monkeypatch):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail the test if the run gets as far as joining a process group."""

    def built(*args, **kwargs):
        raise AssertionError("the run was built")

    monkeypatch.setattr(trainer, "init_distributed", built)


@pytest.mark.parametrize("where", ["the directory itself", "a parent"])
def test_a_file_in_the_way_of_the_output_directory_exits_2_before_anything_is_built(
    inline_env, nothing_built, tiny_overrides, tmp_path, capsys, where
):
    blocker = tmp_path / "blocker"
    blocker.write_text("not a directory")
    out = blocker if where == "the directory itself" else blocker / "run"
    assert main(["run", *tiny_overrides, f"trainer.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "trainer.output_dir: cannot be written: a file is in the way" in err and "Traceback" not in err, err
    assert f"(got '{out}')" in err and "free of" in err


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (errno.EROFS, "a read-only file system [EROFS]"),
        (errno.EACCES, "permission denied [EACCES]"),
        (errno.ENOSPC, "no space left on the device [ENOSPC]"),
    ],
)
def test_an_unwritable_output_directory_exits_2_naming_the_cause(
    inline_env, nothing_built, tiny_overrides, tmp_path, capsys, monkeypatch, code, words
):
    def refuse(probe: Path) -> None:
        raise OSError(code, "refused", str(probe))

    monkeypatch.setattr(storage, "_write_probe", refuse)
    assert main(["run", *tiny_overrides]) == 2
    err = capsys.readouterr().err
    assert f"trainer.output_dir: cannot be written: {words}" in err and "free of" in err, err


def fail_writes_into(step_dir: str, error: BaseException):
    """A DCP file writer that writes a little of ``step_dir``'s data and then fails with ``error``."""
    real = dcp_filesystem._write_item

    def write_item(transforms, stream, *args, **kwargs):
        if step_dir in str(getattr(stream, "name", "")):
            stream.write(b"half a tensor")
            raise error
        return real(transforms, stream, *args, **kwargs)

    return write_item


def step_losses(out: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["step_loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), "no space left on the device [ENOSPC]"),
        # what torch.save says when the disk fills under it: no errno, only the free space tells
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
         "RuntimeError: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
    ],
    ids=["ENOSPC", "torch.save"],
)  # fmt: skip
def test_a_checkpoint_that_cannot_be_written_is_named_removed_and_the_one_before_resumes(
    inline_env, tiny_overrides, tmp_path, capsys, monkeypatch, error, words
):
    args = ["run", *tiny_overrides, "trainer.steps=4", "trainer.checkpoint_every=2", "trainer.eval_at_end=false"]
    with monkeypatch.context() as patch:
        patch.setattr(dcp_filesystem, "_write_item", fail_writes_into("step_00000004", error))
        assert main(args) == 1
    err = capsys.readouterr().err
    root = tmp_path / "gem-tiny" / "checkpoints"
    assert f"CheckpointWriteError: the checkpoint of step 4 could not be written to {root / 'step_00000004.partial'}" in err
    assert f"on rank 0: {words}" in err and "free of" in err, err
    assert f"The partial folder was removed; the checkpoints before stay as they were. Resume point: {root / 'step_00000002'}" in err
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"] and verify(root / "step_00000002") == []
    before = step_losses(tmp_path / "gem-tiny")
    assert main(args) == 0  # space again: the same command continues from step 2
    assert f"continuing from {root / 'step_00000002'} (step 2 of 4)" in capsys.readouterr().out
    assert step_losses(tmp_path / "gem-tiny") == before


def test_free_space_is_read_from_the_nearest_existing_folder(tmp_path):
    said = storage.free_space(tmp_path / "not" / "yet" / "there")
    total = shutil.disk_usage(tmp_path).total
    assert said.endswith(f"of {storage._size(total)}") and " free of " in said
