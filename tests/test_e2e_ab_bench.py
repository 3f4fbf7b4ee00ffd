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


def test_the_backward_thread_switch_is_undone(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import torch
    from ab_switches import VARIANTS

    before = torch._C._is_multithreading_enabled()
    undo = VARIANTS["backward_on_main_thread"](None)
    assert torch._C._is_multithreading_enabled() is False
    undo()
    assert torch._C._is_multithreading_enabled() == before


def test_the_old_sequence_rows_give_the_same_rows_and_are_undone(monkeypatch):
    """``sequence_rows_as_before`` swaps in the old candidate insertion, position gather and output split
    (the same rows and gradients as the new ones) and puts the new ones back."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import torch
    from ab_switches import VARIANTS

    from gem_model import jagged
    from gem_model.model import sequence_input, sequence_pool

    new = jagged.insert_one, sequence_input.position_rows, sequence_pool.split_rows
    lengths = torch.tensor([3, 0, 2])
    values, extra = torch.randn(5, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    grad = torch.randn(8, 4)
    hist, last = torch.tensor([0, 1, 2, 5, 6]), torch.tensor([3, 4, 7])

    def moved() -> tuple[torch.Tensor, ...]:
        out, _ = jagged.append_one(values, lengths, extra)
        a, b = sequence_pool.split_rows(out, hist, last)
        return (out.detach(), *torch.autograd.grad((a, b), (values, extra), (grad[hist], grad[last])))

    want = moved()
    undo = VARIANTS["sequence_rows_as_before"](None)
    assert (jagged.insert_one, sequence_input.position_rows, sequence_pool.split_rows) != new
    assert all(torch.equal(a, b) for a, b in zip(moved(), want))
    undo()
    assert (jagged.insert_one, sequence_input.position_rows, sequence_pool.split_rows) == new


def test_the_ddp_switch_turns_the_reducer_off_at_one_rank_and_refuses_without_ddp(monkeypatch, tmp_path):
    """``ddp_no_sync`` on a real one-rank gloo DDP: the gradients are those of the synchronised step, the
    flag comes back on undo, and a run without DDP is refused naming why."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from ab_switches import VARIANTS

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))
        x = torch.randn(4, 3)
        ddp(x).square().sum().backward()
        synced = ddp.module.weight.grad.clone()
        ddp.module.weight.grad = None
        undo = VARIANTS["ddp_no_sync"](SimpleNamespace(model=torch.nn.Sequential(ddp)))
        assert ddp.require_backward_grad_sync is False
        ddp(x).square().sum().backward()
        assert torch.equal(ddp.module.weight.grad, synced)
        undo()
        assert ddp.require_backward_grad_sync is True
    finally:
        if own_group:
            dist.destroy_process_group()
    with pytest.raises(ValueError, match="ddp_no_sync: the run has no DistributedDataParallel module"):
        VARIANTS["ddp_no_sync"](SimpleNamespace(model=torch.nn.Linear(2, 2)))


def test_steady_rounds_below_one_are_refused(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import e2e_ab

    monkeypatch.setattr(sys, "argv", ["e2e_ab.py", "--worker", "--steady", "2", "--steady-rounds", "0"])
    with pytest.raises(SystemExit):
        e2e_ab.main()
    assert "--steady-rounds must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("switch", "module", "flag", "shipped"),
    [
        # the bf16 linears' float32 gradients off (their cast form)
        ("bf16_grads_cast", "gem_precision.bf16_linear", "FLOAT32_GRADS", True),
        # the bf16 linears' shared cast cache on (off as shipped: not yet timed)
        ("cast_once", "gem_precision.bf16_linear", "CAST_ONCE", False),
        # the attention's tensor-descriptor loads off (pointer loads)
        ("attention_pointer_loads", "gem_kernels.attention_triton_common", "TMA_LOADS", True),
        # fp8_saved's attention output kept as computed (not in e4m3 rows)
        ("fp8_saved_attn_as_computed", "gem_kernels.hstu_gap_triton", "SAVED_ATTENTION_E4M3", True),
        # fp8_saved's rows expanded before the norm-gate backward; the norm-gate forward's rows as bytes
        ("fp8_saved_rows_expanded", "gem_kernels.hstu_gap_triton", "E4M3_ROWS_IN_NORM_GATE", True),
        ("fp8_byte_stores", "gem_kernels.norm_gate_triton", "E4M3_WORD_STORES", True),
        # the Gluon attention forward and dq pass on (off as shipped: not faster in a step on the H200)
        ("gluon_forward", "gem_kernels.attention_gluon", "FORWARD", False),
        ("gluon_dq", "gem_kernels.attention_gluon", "DQ", False),
        # the Triton dk/dv pass (the Gluon one is shipped)
        ("triton_dkdv", "gem_kernels.attention_gluon", "DKDV", True),
        # the uvqk GEMM with the silu in its epilogue (off as shipped: slower on the H200); out's GEMM by
        # cuBLAS and the residual added after it (the Triton GEMM with the residual is shipped)
        ("linear_silu", "gem_kernels.hstu_block", "LINEAR_SILU", False),
        ("residual_add", "gem_kernels.hstu_block", "LINEAR_RESIDUAL", True),
        # the shared negatives' unit rows, and the bf16 linears' bias gradients, by torch (the Triton
        # passes are shipped)
        ("torch_unit_rows", "gem_kernels.next_item_loss_triton", "UNIT_ROWS_KERNEL", True),
        ("torch_bias_grad", "gem_precision.bf16_linear", "BIAS_GRAD_KERNEL", True),
    ],
)
def test_a_flag_switch_flips_its_flag_and_undoes(monkeypatch, switch, module, flag, shipped):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import importlib

    from ab_switches import VARIANTS

    owner = importlib.import_module(module)
    assert getattr(owner, flag) is shipped
    undo = VARIANTS[switch](None)
    assert getattr(owner, flag) is (not shipped)
    undo()
    assert getattr(owner, flag) is shipped


def test_the_bias_sums_switch_flips_both_flags_and_undoes(monkeypatch):
    """``bias_sums_in_linear``: the bf16 linears sum their bias gradients themselves (as shipped, they ask the
    layer norm backward, which sums)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ab_switches import VARIANTS

    from gem_kernels import layer_norm_triton
    from gem_precision import bf16_linear

    def flags() -> tuple[bool, bool]:
        return bf16_linear.BIAS_SUMS_FROM_PRODUCER, layer_norm_triton.COLUMN_SUMS

    shipped = flags()
    assert shipped == (True, True)
    undo = VARIANTS["bias_sums_in_linear"](None)
    assert flags() == (False, False)
    undo()
    assert flags() == shipped


@pytest.mark.parametrize("config", ["m64n32p2", "m64n32s2p2"])
def test_the_gluon_dq_config_switches_route_the_dq_pass_at_their_config_and_undo(monkeypatch, config):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ab_switches import VARIANTS

    from gem_kernels import attention_gluon

    shipped = (attention_gluon.DQ, attention_gluon.DEFAULT_DQ_CONFIG)
    undo = VARIANTS[f"gluon_dq_{config}"](None)
    assert (attention_gluon.DQ, attention_gluon.DEFAULT_DQ_CONFIG) == (True, config)
    assert config in attention_gluon.DQ_CONFIGS
    undo()
    assert (attention_gluon.DQ, attention_gluon.DEFAULT_DQ_CONFIG) == shipped


def test_the_pointwise_unpipelined_switch_is_undone(monkeypatch):
    """``pointwise_unpipelined`` puts the norm-gate's and the sums pass's launches of before the pipeline back, and undoes."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ab_switches import VARIANTS

    from gem_kernels import hstu_gap_grad_rows, norm_gate_triton

    def launches() -> tuple:
        return (norm_gate_triton.PIPELINE_STAGES, norm_gate_triton.FORWARD_TILES,
                norm_gate_triton.BACKWARD_PROGRAMS_PER_SM, hstu_gap_grad_rows.PIPELINE_STAGES)  # fmt: skip

    shipped = launches()
    undo = VARIANTS["pointwise_unpipelined"](None)
    assert launches() == (None, 1, 4, None) != shipped
    undo()
    assert launches() == shipped



def test_the_recat_cache_switches_install_and_undo_and_refuse_what_is_already_so(monkeypatch):
    """``recat_cache`` puts gem_parallel.recat_cache in front of torchrec's permutation and takes it out;
    with a cache already in it refuses (its A rows would not be without the cache). ``no_recat_cache``
    takes the installed one out and puts one back; with none in it refuses."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ab_switches import VARIANTS
    from torchrec.distributed import dist_data

    from gem_parallel import recat_cache

    recat_cache.uninstall()  # a run in this process may have left the planner's (it keeps it for the process)
    original = dist_data._get_recat
    with pytest.raises(ValueError, match="no_recat_cache: no recat cache is installed"):
        VARIANTS["no_recat_cache"](None)
    undo = VARIANTS["recat_cache"](None)
    assert recat_cache.installed() and dist_data._get_recat is not original
    with pytest.raises(ValueError, match="recat_cache: the cache is already installed"):
        VARIANTS["recat_cache"](None)
    # no_recat_cache takes out the cache whoever installed it, and puts one back when undone
    put_back = VARIANTS["no_recat_cache"](None)
    assert not recat_cache.installed() and dist_data._get_recat is original
    put_back()
    assert recat_cache.installed()
    recat_cache.uninstall()
    undo()  # its own cache is gone already: a no-op
    assert not recat_cache.installed() and dist_data._get_recat is original


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


def test_the_mixer_backend_switch_keeps_cudnn_out_and_undoes(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ab_switches import VARIANTS
    from torch.nn.attention import SDPBackend

    from gem_model.model import hstu

    assert hstu.MIXER_SDPA_BACKENDS is None  # torch's choice, as shipped
    undo = VARIANTS["mixer_no_cudnn"](None)
    assert hstu.MIXER_SDPA_BACKENDS and SDPBackend.CUDNN_ATTENTION not in hstu.MIXER_SDPA_BACKENDS
    undo()
    assert hstu.MIXER_SDPA_BACKENDS is None



@pytest.mark.parametrize(
    ("switch", "field", "value"),
    [("dq_atomic", "dq", "atomic"), ("dq_separate", "dq", "separate"), ("dq_stored", "dq", "stored"),
     ("fp8_attention", "fp8_forward", True), ("bias_grad_by_linear", "bias_grad_in_gap", False)],
)  # fmt: skip
def test_an_attention_option_switch_sets_the_kernels_option_and_undoes(monkeypatch, switch, field, value):
    """Each switch sets one option of the run's attention kernel (a validated config: a name the kernel does not
    know would fail here) and puts the config back."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from ab_switches import VARIANTS

    from gem_kernels.attention import TritonJaggedAttention

    kernel = TritonJaggedAttention(TritonJaggedAttention.Config())
    shipped = kernel.config
    undo = VARIANTS[switch](SimpleNamespace(components=SimpleNamespace(attention=kernel)))
    assert getattr(kernel.config, field) == value and getattr(shipped, field) != value
    type(kernel.config).model_validate(kernel.config.model_dump())
    undo()
    assert kernel.config is shipped
