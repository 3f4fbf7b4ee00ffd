"""One run per output directory: a second run into a directory another live run holds exits 2 at
once naming the holder's pid and host, and touches nothing; a lock file a killed run left is taken
over, saying whose it was."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from gem_model.cli import main
from gem_model.train.lock import LOCK, OutputLock, check_free


@pytest.fixture
def inline_env(monkeypatch):
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")


@pytest.fixture
def held(tmp_path):
    """``tmp_path/gem-tiny`` held by a live run (this process, through its own lock), with a
    checkpoint that run is writing."""
    out = tmp_path / "gem-tiny"
    out.mkdir()
    partial = out / "checkpoints" / "step_00000002.partial"
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"being written")
    lock = OutputLock(out)
    assert lock.acquire() is None
    yield out, partial
    lock.release()


@pytest.mark.parametrize(
    ("nproc", "planner"), [("1", "inline_single"), ("2", "inline_replicated")], ids=["one", "torchrun"]
)  # with 2 processes, refused before torchrun starts
def test_a_second_run_into_a_held_directory_exits_2_naming_the_holder(
    held, inline_env, tiny_overrides, capsys, nproc, planner
):
    out, partial = held
    assert main(["run", "--nproc", nproc, *tiny_overrides, f"parallel.planner={planner}", "trainer.steps=2"]) == 2
    err = capsys.readouterr().err
    assert f"trainer.output_dir: is in use by another run: pid {os.getpid()} on host {socket.gethostname()}" in err
    assert f"which holds {out / LOCK}" in err and "Traceback" not in err
    assert (partial / "__0_0.distcp").read_bytes() == b"being written"  # the live run's partial is untouched
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", LOCK]  # no metrics, nothing else written


def test_a_stale_lock_of_a_killed_run_is_taken_over(inline_env, tiny_overrides, tmp_path, capsys):
    out = tmp_path / "gem-tiny"
    out.mkdir()
    killed = {"pid": 999_999_999, "host": "node7", "started": "2026-12-01T10:00:00+00:00"}
    (out / LOCK).write_text(json.dumps(killed))  # its process is gone, and with it its flock
    assert main(["run", *tiny_overrides, "trainer.steps=2"]) == 0
    said = capsys.readouterr().out
    assert f"took over {out / LOCK} from pid 999999999 on host node7 (started 2026-12-01T10:00:00+00:00)" in said
    assert (out / LOCK).read_text() == ""  # let go at the end: no run holds it
    check_free(out)


def test_checks_by_several_ranks_do_not_collide_and_a_holder_refuses(tmp_path: Path):
    out = tmp_path / "out"
    out.mkdir()
    first, second = OutputLock(out), OutputLock(out)
    check_free(out)
    check_free(out)  # shared: the checks of a run's ranks never see each other as holders
    assert first.acquire() is None
    refusal = second.acquire()
    assert refusal is not None and f"pid {os.getpid()}" in str(refusal)
    first.release()
    assert second.acquire() is None
    second.release()
