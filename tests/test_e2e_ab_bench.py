"""benchmarks/e2e_ab.py on the CPU (one process, the tiny config, the real plugins, a variant with three
switches applied and undone between steps): every variant trains every timed batch, the A/A pair is
reported batch by batch, and the steady steps run in rotated rounds whose per-round comparison reaches
the JSON. The switches of benchmarks/ab_switches.py that change the live model are undone exactly."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from gem_model import testing

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = "gem_kernels.plugin,gem_precision.plugin,gem_parallel.plugin,gem_comm.plugin"


def test_two_variants_train_the_same_batches_and_the_steady_rounds_are_compared(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GEM_PLUGINS", PLUGINS)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import e2e_ab

    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", [
        "e2e_ab.py", "--worker", "--config", str(ROOT / "configs" / "tiny.yaml"), "--device", "cpu",
        "--warmup", "1", "--steps", "3", "--steady", "2", "--steady-rounds", "3",
        "--variants", "A=base,B=index_add_mean+pageable_bags+torch_loss+rows_by_element+loss_before_backward",
        "--out", str(out),
    ])  # fmt: skip
    from gem_model import host_copy, jagged
    from gem_model.model import lookup_bags

    gemm_limit, as_words = jagged.MEMBERSHIP_GEMM_ELEMENTS, jagged._as_words
    assert e2e_ab.main() == 0
    # the switches were undone at the end: the module state is as before the run
    assert jagged.MEMBERSHIP_GEMM_ELEMENTS == gemm_limit and lookup_bags.to_device_async is host_copy.to_device_async
    assert jagged._as_words is as_words
    printed = capsys.readouterr().out
    assert "B against A, batch by batch" in printed and "steady B against the first variant, round by round" in printed
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert set(rows) == {"A", "B"}
    assert all(len(r["wall_ms"]) == 3 and len(r["losses"]) == 3 for r in rows.values())
    assert [s["variant"] for s in result["summary"]] == ["A", "B"] and result["summary"][1]["paired"]["batches"] == 3
    steady = result["meta"]["steady"]
    assert all(len(st["rounds_wall_ms"]) == 3 and st["steps"] == 2 for st in steady.values())
    assert steady["B"]["against_first"]["rounds"] == 3 and "against_first" not in steady["A"]
    a, b = steady["A"]["rounds_wall_ms"], steady["B"]["rounds_wall_ms"]
    want = sorted(x / y for x, y in zip(a, b, strict=True))[1]
    assert steady["B"]["against_first"]["median"] == pytest.approx(want)
    # each timed step's and steady round's time window is kept for the GPU's power samples; on the CPU
    # nothing is sampled and nothing about power is printed
    assert all(len(r["windows"]) == 3 and all(t0 < t1 for t0, t1 in r["windows"]) for r in rows.values())
    assert all(len(st["windows"]) == 3 for st in steady.values())
    assert all(s["power"] is None for s in result["summary"]) and "power" not in printed


def test_the_loss_kernel_switch_is_undone(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ab_switches import VARIANTS

    from gem_model.model.next_item import TorchNextItemLoss

    run = testing.fake_run_context(output_dir=tmp_path)  # its model is the GemModel itself (inline_single)
    own = run.model.loss_kernel
    undo = VARIANTS["torch_loss"](run)
    assert type(run.model.loss_kernel) is TorchNextItemLoss and run.model.loss_kernel is not own
    undo()
    assert run.model.loss_kernel is own


@pytest.mark.parametrize("name", ["torch", "triton"])
@pytest.mark.parametrize("op,attr", [("sequence_pool", "pool_kernel"), ("sequence_input", "input_kernel")])
def test_the_tower_end_switches_swap_the_kernel_and_are_undone(tmp_path, monkeypatch, name, op, attr):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ab_switches import VARIANTS

    run = testing.fake_run_context(output_dir=tmp_path)  # its model is the GemModel itself (inline_single)
    own = getattr(run.model, attr)
    undo = VARIANTS[f"{name}_{op}"](run)
    assert getattr(run.model, attr).name == name and getattr(run.model, attr).op == op
    assert getattr(run.model, attr) is not own
    undo()
    assert getattr(run.model, attr) is own


def test_steady_rounds_below_one_are_refused(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import e2e_ab

    monkeypatch.setattr(sys, "argv", ["e2e_ab.py", "--worker", "--steady", "2", "--steady-rounds", "0"])
    with pytest.raises(SystemExit):
        e2e_ab.main()
    assert "--steady-rounds must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("non_finite", ["halt", "skip"])
def test_the_loss_check_switches_move_the_read_and_refuse_what_cannot_run(monkeypatch, tmp_path, non_finite):
    """``loss_at_tables`` and ``loss_before_backward`` on a real one-process run: each moves where the
    step reads its loss until undone; switching to where it already is, or to the tables under
    ``trainer.non_finite=skip``, is refused naming why."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ab_switches import VARIANTS

    from gem_model.config_io import load_config
    from gem_model.plugins import GemPluginManager
    from gem_model.trainer import started_run

    overrides = [*testing.INLINE_OVERRIDES, f"trainer.output_dir={tmp_path}", f"trainer.non_finite={non_finite}"]
    with started_run(load_config(None, overrides), GemPluginManager(autoload=False, plugins=[testing])) as run:
        step = run.core_step
        if non_finite == "skip":  # auto reads it before backward under skip
            assert step.in_backward is False
            with pytest.raises(ValueError, match="loss_at_tables: trainer.non_finite=skip needs the loss before backward"):
                VARIANTS["loss_at_tables"](run)
            with pytest.raises(ValueError, match="loss_before_backward: the run already reads its loss before backward"):
                VARIANTS["loss_before_backward"](run)
            return
        assert step.in_backward is True  # auto, under halt, on one rank
        with pytest.raises(ValueError, match="loss_at_tables: the run already reads its loss at the tables"):
            VARIANTS["loss_at_tables"](run)
        undo = VARIANTS["loss_before_backward"](run)
        assert step.in_backward is False
        again = VARIANTS["loss_at_tables"](run)
        assert step.in_backward is True
        again()
        undo()
        assert step.in_backward is True


def test_the_lookup_dtype_switch_finds_torchrecs_sharded_tables_in_a_live_run(tmp_path, monkeypatch, capsys):
    """Through a real ``torchrec_ddp`` run (this process as a one-rank torchrun launch, gloo): ``fp16_lookup``
    (``bf16_lookup``'s CPU twin) and ``f32_lookup`` reach FBGEMM's modules inside torchrec's sharded collection (kept in a
    plain list, not as submodules), or e2e_ab stops with its refusal; every variant trains every batch to
    a finite loss; a run without FBGEMM tables is refused."""
    import socket

    import torch

    monkeypatch.setenv("GEM_PLUGINS", PLUGINS)
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"TORCHELASTIC_RUN_ID": "ab", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    import e2e_ab

    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", [
        "e2e_ab.py", "--worker", "--config", str(ROOT / "configs" / "tiny.yaml"), "--device", "cpu",
        "--warmup", "1", "--steps", "2", "--variants", "A=base,F=fp16_lookup,G=f32_lookup",
        "--set", "parallel.planner=torchrec_ddp", "--set", f"trainer.output_dir={tmp_path / 'run'}", "--out", str(out),
    ])  # fmt: skip
    assert e2e_ab.main() == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"A", "F", "G"} and all(len(r["losses"]) == 2 for r in rows.values())
    assert all(math.isfinite(x) for r in rows.values() for x in r["losses"])

    from types import SimpleNamespace

    from ab_switches import VARIANTS

    no_tables = SimpleNamespace(model=SimpleNamespace(sparse=SimpleNamespace(ec=torch.nn.Linear(2, 2))))
    with pytest.raises(SystemExit, match="fp16_lookup: the run has no FBGEMM table modules"):
        VARIANTS["fp16_lookup"](no_tables)
