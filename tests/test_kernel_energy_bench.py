"""benchmarks/kernel_energy.py on the CPU: what it refuses before touching a GPU, and its per-unit figures.
Its measurements need a GPU and nvidia-smi (benchmarks/results/e2e_ab.md has them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def kernel_energy(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import kernel_energy

    return kernel_energy


@pytest.fixture
def energy_attention(kernel_energy):
    import kernel_energy_attention

    return kernel_energy_attention


def test_a_settle_as_long_as_the_run_is_refused(kernel_energy, capsys):
    with pytest.raises(SystemExit) as e:
        kernel_energy.main(["--seconds", "2", "--settle", "2"])
    assert e.value.code == 2 and "--settle (2.0) must be shorter than --seconds (2.0)" in capsys.readouterr().err


def test_without_a_gpu_it_says_so(kernel_energy, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="measures a GPU; none is visible"):
        kernel_energy.main([])


def test_energy_per_flop_and_per_byte(kernel_energy):
    assert kernel_energy.per_unit(0.5, 1e12) == pytest.approx(0.5)  # 0.5 J over 1e12 FLOP: 0.5 pJ each
    assert kernel_energy.per_unit(None, 1e12) is None and kernel_energy.per_unit(0.5, 0.0) is None


def test_the_gemm_kernels_pass_their_checks_and_count_their_work(kernel_energy):
    """On the CPU at 512 rows: each GEMM is checked against its float32 product on the way (a wrong one
    ends the run), and the FLOPs and bytes a call are the shapes'."""
    rows = 512
    kernels = kernel_energy.gemm_kernels(rows, torch.device("cpu"), torch.Generator().manual_seed(3))
    assert set(kernels) == {"uvqk_fwd", "uvqk_fwd_nobias", "uvqk_dgrad", "uvqk_wgrad", "out_fwd", "uvqk_fwd_fp8", "copy"}
    assert kernels["uvqk_fwd_nobias"].flops == kernels["uvqk_fwd"].flops
    assert kernels["uvqk_fwd"].flops == 2.0 * rows * 1024 * 4096 == kernels["uvqk_wgrad"].flops
    assert kernels["out_fwd"].flops == 2.0 * rows * 1024 * 1024
    assert kernels["copy"].flops == 0 and kernels["copy"].bytes == 2 * rows * 4096 * 2  # read and write, bf16
    assert kernels["uvqk_dgrad"].call().shape == (rows, 1024) and kernels["uvqk_wgrad"].call().shape == (4096, 1024)
    # the e4m3 weight gradient as fp8_blocks runs it (emulated here), checked against float32 on the way
    blocks = kernel_energy.fp8_weight_grad_kernels(300, torch.device("cpu"), torch.Generator().manual_seed(4))
    assert blocks["uvqk_wgrad_fp8_blocks"].flops == 2.0 * 300 * 1024 * 4096
    assert blocks["uvqk_wgrad_fp8_blocks"].call().shape == (4096, 1024)
    assert blocks["cast_t_blocks"].bytes == 3.0 * 300 * (1024 + 4096)  # bf16 read, e4m3 written


# the script poisons the ds buffer with NaN before its checks; the dq pass multiplies whole [64, 64] blocks, and rows
# past a sequence's end (dropped at its store) then carry NaN through numpy's matmul under the interpreter
@pytest.mark.filterwarnings("ignore:(overflow|invalid value) encountered in matmul:RuntimeWarning")
def test_the_attention_backwards_agree_before_they_are_measured(energy_attention):
    """Under the interpreter on three short sequences: the shipped backward, the one with atomic ``dq`` and
    the one with ``dq`` from stored ``ds`` tiles pass the agreement check the script makes before measuring,
    and each call gives ``dq``, ``dk``, ``dv``; the stored form's two passes count 4 and 1 MMAs a pair."""
    from attention_gluon import inputs_of
    from jagged_attention import Case

    lengths = torch.tensor([5, 40, 70])
    x = inputs_of(Case(3, 2, 64, 70, 0.6, lengths="powerlaw"), lengths, torch.ones_like(lengths), 1, torch.device("cpu"))
    kernels = energy_attention.attention_backwards(x, forward_flops=2.0)
    assert set(kernels) == {"attention_backward", "attention_backward_atomic", "attention_backward_stored",
                            "attention_dkdv_stored", "attention_dq_stored"}  # fmt: skip
    assert kernels["attention_backward"].flops == 7.0 and kernels["attention_backward_atomic"].flops == 5.0
    assert kernels["attention_backward_stored"].flops == 5.0
    assert kernels["attention_dkdv_stored"].flops == 4.0 and kernels["attention_dq_stored"].flops == 1.0
    for name in ("attention_backward_atomic", "attention_backward_stored"):
        dq, dk, dv = kernels[name].call()
        assert dq.shape == dk.shape == dv.shape == x["q"].shape and bool(torch.isfinite(dq).all())


def test_the_fp8_forward_is_checked_against_the_bf16_forward_before_it_is_measured(energy_attention):
    """Under the interpreter on three short sequences: the e4m3 ``q k^T`` forward passes the script's check
    against the bf16 forward, counts the bf16 forward's FLOPs, and writes its output where it is told."""
    from attention_gluon import inputs_of, triton_pass
    from jagged_attention import Case

    lengths = torch.tensor([5, 40, 70])
    x = inputs_of(Case(3, 2, 32, 70, 0.6, lengths="powerlaw"), lengths, torch.ones_like(lengths), 1, torch.device("cpu"))
    out = torch.full_like(x["q"], float("nan"))
    kernels = energy_attention.attention_forward_fp8(x, forward_flops=2.0, out=out)
    assert set(kernels) == {"attention_forward_fp8"} and kernels["attention_forward_fp8"].flops == 2.0
    (y,) = kernels["attention_forward_fp8"].call()
    assert y is out and bool(torch.isfinite(out).all())
    bf16 = triton_pass(x, "forward")[0].float()
    error = ((out.float() - bf16).norm() / bf16.norm()).item()
    assert 0 < error <= energy_attention.FP8_FORWARD_TOLERANCE  # e4m3 rounds: not the bf16 result, close to it


def test_each_attention_config_is_pinned_checked_and_put_back(energy_attention):
    """Under the interpreter on three short sequences, with two configs a pass that it can run: each pinned
    row launches its own config (the tuned kernel's last launch says which), passes the check against the
    tuned config's output, and leaves the tuner's pick in place for every other caller."""
    from attention_gluon import inputs_of, triton_pass
    from jagged_attention import Case

    from gem_kernels import attention_triton as at

    lengths = torch.tensor([5, 40, 70])
    x = inputs_of(Case(3, 2, 32, 70, 0.6, lengths="powerlaw"), lengths, torch.ones_like(lengths), 1, torch.device("cpu"))
    out = {"forward": (torch.empty_like(x["q"]),), "dq": (torch.empty_like(x["q"]),)}
    tables = {"forward": [(16, 16, 1, 1, 1), (32, 16, 1, 1, 1)], "dq": [(16, 16, 1, 1, 1), (32, 16, 1, 1, 1)]}
    kernels = energy_attention.attention_configs(x, forward_flops=2.0, out=out, tables=tables, dkdv=False)
    assert set(kernels) == {f"attention_{w}@{b}x16x1x1x1" for w in ("forward", "dq") for b in (16, 32)}
    assert kernels["attention_dq@32x16x1x1x1"].flops == 3.0 and kernels["attention_forward@16x16x1x1x1"].flops == 2.0
    for which, tuned in (("forward", at.FORWARD), ("dq", at.DQ)):
        want = triton_pass(x, which)[0]
        key, auto = tuned.last
        out[which][0].fill_(float("nan"))
        (got,) = kernels[f"attention_{which}@32x16x1x1x1"].call()
        assert tuned.last == (key, (32, 16, 1, 1, 1)) and tuned.chosen[key] == auto != (32, 16, 1, 1, 1)
        assert got is out[which][0] and torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        triton_pass(x, which)
        assert tuned.last == (key, auto)
