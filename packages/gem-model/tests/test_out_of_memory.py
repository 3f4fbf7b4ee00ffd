"""A step that runs the device out of memory: ``gem-train run`` exits 1 with torch's account of the memory
and what the run adds to it (the step, the last checkpoint, the settings that lower the peak, each with
its value), and the metrics of the steps before it are written."""

from __future__ import annotations

import json

import pytest

from gem_model.cli import main
from gem_model.testing_faults import OOM_MESSAGE
from gem_model.train.out_of_memory import torch_account


@pytest.mark.parametrize("checkpoint_every", [0, 2])
def test_the_step_the_checkpoint_and_the_settings_are_named(monkeypatch, capsys, tmp_path, tiny_overrides,
                                                            checkpoint_every):  # fmt: skip
    monkeypatch.setenv("GEM_PLUGINS", "gem_model.testing")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    out = tmp_path / "run"
    code = main(["run", *tiny_overrides, f"trainer.output_dir={out}", "trainer.steps=6",
                 f"trainer.checkpoint_every={checkpoint_every}", "data.global_batch_size=8",
                 "callbacks=[{name: inline_fault, options: {rank: 0, at_step: 4, fault: oom}}]"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1, err
    assert "DeviceOutOfMemoryError: [gem-tiny] the device ran out of memory in step 4 of 6: CUDA out of memory." in err
    assert "9.57 GiB is reserved by PyTorch but unallocated." in err and "See documentation" not in err
    assert "data.global_batch_size (now 8)" in err and "model.max_seq_len (now 16)" in err
    assert "activation.policy (now 'inline_none'" in err
    # gem-train run set the allocator itself; a run that did not is told about it
    assert "expandable_segments" not in err.split("What lowers the peak")[1]
    if checkpoint_every:
        assert f"the last checkpoint is {out / 'checkpoints' / 'step_00000002'}, and the same command continues" in err, err
    else:
        assert "no checkpoint was written before it (trainer.checkpoint_every=N" in err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "step_loss" in json.loads(line)]  # fmt: skip
    assert steps == [1, 2, 3]  # nothing before the failed step is lost


def test_torchs_account_stops_before_its_advice():
    account = torch_account(__import__("torch").OutOfMemoryError(OOM_MESSAGE))
    assert account.startswith("CUDA out of memory. Tried to allocate 1.86 GiB.")
    assert account.endswith("9.57 GiB is reserved by PyTorch but unallocated.")


def test_a_run_whose_allocator_splits_blocks_is_told_about_expandable_segments(monkeypatch, tiny_config, pm):
    import torch

    from gem_model.train.out_of_memory import out_of_memory_error

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    error = out_of_memory_error(tiny_config, pm, 0, torch.OutOfMemoryError(OOM_MESSAGE), None)
    assert "step 1 of" in str(error) and "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in str(error)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:128")
    assert "expandable_segments" not in str(out_of_memory_error(tiny_config, pm, 0, torch.OutOfMemoryError("x"), None))
