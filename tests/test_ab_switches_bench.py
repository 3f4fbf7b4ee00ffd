"""benchmarks/ab_switches.py on the CPU, without a training run: each switch that changes a flag, a function or a
component option sets what it names and undoes exactly (the switches that need a live run are tested in
test_e2e_ab_bench.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
        # the uvqk bias's u columns summed by the gap's last pass (the norm-gate backward sums them, shipped)
        ("u_sums_in_grad_rows", "gem_kernels.hstu_gap_triton", "U_SUMS_IN_NORM_GATE", True),
        # the sequence lookup's gradients by feature (split backward, adds): one buffer is shipped
        ("table_grads_by_feature", "gem_model.model.embeddings", "ONE_GRADIENT_BUFFER", True),
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
