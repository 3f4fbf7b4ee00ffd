"""The fused gap's ``q`` columns completed by the stored ``dq`` pass (``hstu_gap_triton.Q_SILU_IN_DQ``): ``dq`` times
``silu'(pre)`` and its column sums there, the last pass skipping those columns, against the gap with the flag
off (the last pass does them) and against float64; with every head in one buffer and a head at a time.
Triton runs in its interpreter; fresh memory is NaN (``poison``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from gem_kernels import attention_stored
from gem_kernels import hstu_gap_triton as gap
from gem_kernels.attention_stored import dq_from_stored, prepare, silu_sum_slots
from gem_kernels.hstu_gap_grad_rows import silu_grad_rows
from gem_kernels.testing import offsets_from_lengths, relative_error
from gem_model.api import AttentionExtras

pytestmark = pytest.mark.usefixtures("poison")
HEADS, DIM = 2, 64
LENGTHS = [45, 130, 3, 0, 70]


def gap_grads(gen: torch.Generator, dtype: torch.dtype, on: bool, monkeypatch: pytest.MonkeyPatch,
              data: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(d pre, d bias)`` of the gap in ``stored`` mode with the flag ``on``; the block's lent ``uvqk`` bias."""
    monkeypatch.setattr(gap, "Q_SILU_IN_DQ", on)
    pre0, weight, gate_bias, bias0, dy = data
    pre = pre0.to(dtype).requires_grad_()
    bias = bias0.clone().requires_grad_()
    offsets = offsets_from_lengths(LENGTHS)
    y, _ = gap.hstu_gap_triton(pre, weight.to(dtype), gate_bias.to(dtype), offsets, num_heads=HEADS, attention_dim=DIM,
                               value_dim=DIM, max_seq_len=130, alpha=1 / math.sqrt(DIM), eps=1e-5, dq_mode="stored",
                               extras=AttentionExtras(num_targets=torch.tensor([1, 2, 0, 0, 3])), pre_bias=bias)  # fmt: skip
    d_pre, d_bias = torch.autograd.grad(y, (pre, bias), dy.to(dtype))
    return d_pre, d_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads_fit", [HEADS, 1], ids=["all-heads", "a-head-at-a-time"])
def test_the_q_columns_done_in_the_dq_pass_match_the_last_pass(gen, monkeypatch, dtype, heads_fit) -> None:
    rows = sum(LENGTHS)
    width = HEADS * 4 * DIM
    data = (torch.randn(rows, width, generator=gen), torch.randn(HEADS * DIM, generator=gen),
            torch.randn(HEADS * DIM, generator=gen), torch.randn(width, generator=gen) * 0.1,
            torch.randn(rows, HEADS * DIM, generator=gen))  # fmt: skip
    budget = prepare(offsets_from_lengths(LENGTHS), HEADS).buffer_bytes(dtype, heads_fit)
    monkeypatch.setattr(attention_stored, "BUDGET_BYTES", budget)
    calls: list[object] = []
    real_dq, real_rows = attention_stored.dq_from_stored, gap.silu_grad_rows
    monkeypatch.setattr(attention_stored, "dq_from_stored",
                        lambda *a, **kw: calls.append(kw["silu"] is not None) or real_dq(*a, **kw))  # fmt: skip
    monkeypatch.setattr(gap, "silu_grad_rows", lambda *a, **kw: calls.append(kw["q_done"]) or real_rows(*a, **kw))
    on = gap_grads(gen, dtype, True, monkeypatch, data)
    assert calls == [True] * (HEADS // heads_fit) + [slice(2 * HEADS * DIM, 3 * HEADS * DIM)]
    calls.clear()
    off = gap_grads(gen, dtype, False, monkeypatch, data)
    assert calls == [False] * (HEADS // heads_fit) + [None]
    q = slice(2 * HEADS * DIM, 3 * HEADS * DIM)
    for a, name in zip(on, ("d pre", "d bias"), strict=True):
        assert not a.isnan().any(), name
    other = torch.ones(width, dtype=torch.bool)
    other[q] = False
    assert torch.equal(on[0][:, other], off[0][:, other])  # every column but q's: the same passes
    # q's: rounded once (dq times silu') against twice (dq, then times silu'); the sums follow what is stored
    assert relative_error(on[0][:, q], off[0][:, q]) <= (1e-6 if dtype == torch.float32 else 2**-8)
    assert relative_error(on[1], off[1]) <= (1e-6 if dtype == torch.float32 else 2**-8)
    torch.testing.assert_close(on[1][q], on[0][:, q].double().sum(0).float(), rtol=1e-5, atol=1e-4)


def test_the_dq_pass_s_sums_are_one_row_a_block_and_zero_elsewhere(gen) -> None:
    lengths = [130, 0, 65, 1]
    offsets = offsets_from_lengths(lengths)
    rows = sum(lengths)
    q = torch.randn(rows, HEADS, DIM, generator=gen)
    k, g, v = (torch.randn(rows, HEADS, DIM, generator=gen) for _ in range(3))
    plan = prepare(offsets, HEADS)
    stored = plan.scores(torch.float32)
    assert stored is not None
    from gem_kernels.attention_triton_bwd import key_major

    key_major(q, k, v, g, offsets, None, None, stored=stored, out=(torch.empty_like(k), torch.empty_like(v)),
              max_seq_len=130, alpha=0.2, max_attn_len=0)  # fmt: skip
    pre = torch.randn(rows, HEADS, DIM, generator=gen)
    sums = torch.zeros(silu_sum_slots(rows, len(lengths)), HEADS * DIM)
    plain = dq_from_stored(stored, k, offsets, None, max_seq_len=130, alpha=0.2, out=torch.empty_like(q))
    dq = dq_from_stored(stored, k, offsets, None, max_seq_len=130, alpha=0.2, out=torch.empty_like(q), silu=(pre, sums))
    z = pre.double()
    want = plain.double() * torch.sigmoid(z) * (1 + z * (1 - torch.sigmoid(z)))
    torch.testing.assert_close(dq.double(), want, rtol=1e-5, atol=1e-6)
    starts = offsets[:-1].tolist()
    written = {s // 64 + b + p for b, (s, n) in enumerate(zip(starts, lengths, strict=True)) for p in range(-(-n // 64))}
    assert len(written) == sum(-(-n // 64) for n in lengths)  # one row a block, none shared
    for slot in range(sums.shape[0]):
        if slot not in written:
            assert not sums[slot].any(), slot
    torch.testing.assert_close(sums.sum(0), dq.reshape(rows, -1).double().sum(0).float(), rtol=1e-5, atol=1e-5)


def test_bad_silu_arguments_are_named(gen) -> None:
    offsets = offsets_from_lengths([5])
    stored = prepare(offsets, HEADS).scores(torch.float32)
    k = torch.randn(5, HEADS, DIM)
    with pytest.raises(ValueError, match=r"silu's sums must be float32 \[2, 128\]"):  # 5 // 64 + 1 sequence + 1
        dq_from_stored(stored, k, offsets, None, max_seq_len=8, alpha=1.0, out=torch.empty_like(k),
                       silu=(torch.randn(5, HEADS, DIM), torch.zeros(1, HEADS * DIM)))  # fmt: skip
    with pytest.raises(ValueError, match="silu's pre must be"):
        dq_from_stored(stored, k, offsets, None, max_seq_len=8, alpha=1.0, out=torch.empty_like(k),
                       silu=(torch.randn(5, HEADS, 32), torch.zeros(2, HEADS * DIM)))  # fmt: skip
    with pytest.raises(ValueError, match="q_done skips the q columns"):
        silu_grad_rows(torch.zeros(4, 8), torch.zeros(4, 8), 2, None, col_sum=True, q_done=slice(4, 6),
                       dq=(torch.zeros(4, 2), slice(4, 6)))  # fmt: skip


COMPILE = """
import json
from gem_kernels.attention_stored import _dq_stored_kernel
from gem_kernels.attention_triton_common import CHUNK
from gem_kernels.compile_report import compile_kernel
signature = {"DS": "*bf16", "DS_BASE": "*i64", "K": "*bf16", "DQ": "*bf16", "SEQ_OFFSETS": "*i64",
             "NUM_TARGETS": "*i64", "COUNTER": "*i32", "PRE": "*bf16", "SUMS": "*fp32", "stride_km": "i32",
             "stride_kh": "i32", "stride_dqm": "i32", "stride_dqh": "i32", "stride_pm": "i32", "stride_ph": "i32",
             "stride_sums": "i32", "num_seqs": "i32", "num_heads": "i32", "num_rows": "i32", "ds_rows": "i32",
             "scale": "fp32"}
for dim in (128, 64):
    for silu in (False, True):
        constants = dict(DQK=dim, HAS_TARGETS=True, IEEE=False, INTERP=False, CHUNK=CHUNK, TMA=True, SILU=silu)
        r = compile_kernel(_dq_stored_kernel, signature, constants, 4, stages=4)
        print(json.dumps({"dim": dim, "silu": silu, "registers": r["registers"], "stack": r["stack_bytes"]}))
"""


def test_the_dq_pass_with_the_silu_compiles_for_hopper_without_spills() -> None:
    """As the pass launches on the GPU (4 warps, 4 stages, tiles by descriptors): the epilogue takes ``pre`` half
    the columns at a time (whole, it spilled 16 bytes at 255 registers)."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 4
    for report in reports:
        assert report["registers"] is not None and report["stack"] == 0, report
