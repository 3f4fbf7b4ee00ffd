"""A checkpoint cannot run code: a crafted pickle in place of DCP's ``.metadata`` (manifest
re-hashed, so it verifies) is refused with exit 2 naming the file, and none of it runs, on an
automatic resume, an explicit one, and the check of another run's checkpoints."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from gem_model.cli import main
from gem_model.config_io import load_config
from gem_model.distributed import DistEnv
from gem_model.errors import UnsafeCheckpointError
from gem_model.train.checkpoint import Checkpointer
from gem_model.train.integrity import verify, write_manifest
from gem_model.train.safe_load import read_metadata
from gem_model.trainer import train

ITEMS = "data.source.options.num_items=500"


class Payload:
    """What an attacker's pickle does when it is loaded: here, create a folder."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


@pytest.fixture
def crafted(pm, tiny_overrides, tmp_path):
    """A 2-step run whose checkpoint's ``.metadata`` was replaced by the payload, its manifest
    written again so that the checkpoint verifies; returns the checkpoint and the payload's marker."""
    train(load_config(None, [*tiny_overrides, ITEMS, "trainer.steps=2"]), pm)
    checkpoint = tmp_path / "gem-tiny" / "checkpoints" / "step_00000002"
    marker = tmp_path / "the-payload-ran"
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    (checkpoint / "manifest.json").unlink()
    write_manifest(checkpoint)
    assert verify(checkpoint) == []
    return checkpoint, marker


@pytest.mark.parametrize(
    "how",
    [
        ("trainer.steps=4",),  # an automatic resume of the same run
        ("trainer.steps=4", "trainer.resume=true"),  # an explicit one
        ("trainer.steps=4", "data.source.options.num_items=600"),  # another run's: the tensor comparison reads it
    ],
    ids=["auto", "explicit", "another run"],
)
def test_a_crafted_metadata_pickle_is_refused_with_exit_2_and_never_runs(
    crafted, tiny_overrides, monkeypatch, capsys, how
):
    checkpoint, marker = crafted
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    assert main(["run", *tiny_overrides, ITEMS, *how]) == 2
    err = capsys.readouterr().err
    assert "UnsafeCheckpointError" in err and "Traceback" not in err, err
    assert f"{checkpoint / '.metadata'} is refused and nothing of it was run or loaded" in err
    assert "it names posix.mkdir" in err
    assert not marker.exists()  # the payload never ran


def test_the_index_of_a_real_checkpoint_reads_through_the_allow_list(pm, tiny_overrides, tmp_path):
    train(load_config(None, [*tiny_overrides, "trainer.steps=1"]), pm)
    metadata = read_metadata(tmp_path / "gem-tiny" / "checkpoints" / "step_00000001")
    shapes = {k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")}
    assert shapes["model.sparse.ec.embeddings.item.weight"][1] == 32
    assert any(v.properties.dtype == torch.float32 for v in metadata.state_dict_metadata.values() if hasattr(v, "size"))


def test_values_that_are_not_tensors_load_without_running_code(tmp_path):
    """A component's state may hold plain values; one naming code (an object of some class) is refused."""
    path, marker = tmp_path / "step_00000001", tmp_path / "the-payload-ran"
    plain = {"count": 3, "seen": [1, 2.5], "label": "x", "table": torch.arange(4)}
    dcp.save({"components": plain, "evil": Payload(marker)}, checkpoint_id=str(path))
    (path / "meta.json").write_text("{}")
    checkpointer = Checkpointer(tmp_path, DistEnv(0, 1, 0, torch.device("cpu"), None))
    state = {"components": {"count": 0, "seen": [], "label": "", "table": torch.zeros(4, dtype=torch.int64)}}
    checkpointer.load(path, state)
    assert state["components"]["count"] == 3 and state["components"]["seen"] == [1, 2.5]
    assert state["components"]["label"] == "x" and torch.equal(state["components"]["table"], torch.arange(4))
    with pytest.raises(UnsafeCheckpointError, match=r"the value of evil: .*posix\.mkdir"):
        checkpointer.load(path, {"evil": None})
    assert not marker.exists()
