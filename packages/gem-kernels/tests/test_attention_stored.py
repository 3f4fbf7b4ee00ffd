"""``dq_mode="stored"``: the key-major pass stores its score gradients, :func:`dq_from_stored` reads them back
(gem_kernels.attention_stored). Under Triton's interpreter, on poisoned memory (unwritten tiles are NaN)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from gem_kernels import attention_gluon, attention_stored, attention_triton_autograd, attention_triton_bwd
from gem_kernels.attention_stored import StoredScores, dq_from_stored, prepare
from gem_kernels.attention_triton import query_major
from gem_kernels.attention_triton_autograd import jagged_attention_triton
from gem_kernels.attention_triton_bias import NO_BIAS
from gem_kernels.attention_triton_bwd import key_major
from gem_kernels.compile_report import follows
from gem_kernels.hstu_gap_triton import hstu_gap_triton
from gem_kernels.reference import attention_mask
from gem_kernels.testing import offsets_from_lengths, random_qkv
from gem_model.api import NO_EXTRAS, AttentionExtras

pytestmark = pytest.mark.usefixtures("poison")


def tile_rows(lengths: list[int], heads: int) -> dict[tuple[int, int, int, int], int]:
    """The first buffer row of every (sequence, head, key block of 64, query block of 32) tile, counted out
    one by one in the documented order (sequence, head, key block, query block from ``2 j``)."""
    rows, at = {}, 0
    for b, n in enumerate(lengths):
        for h in range(heads):
            for j in range(-(-n // 64)):
                for i in range(2 * j, -(-n // 32)):
                    rows[b, h, j, i] = at
                    at += 32
    return rows


def expected_ds(q, k, v, g, lengths, targets, alpha):  # type: ignore[no-untyped-def]
    """float64 ``mask * <g_i, v_j> * silu'(alpha <q_i, k_j>)`` per sequence, ``[H, n, n]`` each."""
    offsets = offsets_from_lengths(lengths)
    mask = attention_mask(torch.tensor(lengths), targets, 0, max(lengths))
    result = []
    for b, n in enumerate(lengths):
        a, e = int(offsets[b]), int(offsets[b + 1])
        s = alpha * torch.einsum("ihd,jhd->hij", q[a:e].double(), k[a:e].double())
        sig = torch.sigmoid(s)
        dp = torch.einsum("ihd,jhd->hij", g[a:e].double(), v[a:e].double())
        result.append(dp * sig * (1 + s * (1 - sig)) * mask[b, :n, :n])
    return result


def attention_leaves(gen: torch.Generator, rows: int, heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """float32 ``q, k, v`` (leaves) and an output gradient."""
    q, k, v = (t.requires_grad_() for t in random_qkv(rows, heads, dim, dim, torch.float32, gen))
    return q, k, v, torch.randn(q.shape, generator=gen)


def attention_grads(leaves, offsets, max_len, mode) -> tuple[torch.Tensor, ...]:  # type: ignore[no-untyped-def]
    """``dq, dk, dv`` through the autograd function with ``dq_mode=mode``."""
    q, k, v, g = leaves
    out = jagged_attention_triton(q, k, v, offsets, max_seq_len=max_len, alpha=0.3, dq_mode=mode)
    return torch.autograd.grad(out, (q, k, v), g)


def gap_leaves(gen: torch.Generator, rows: int, heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    """The fused HSTU gap's pre-activation (a leaf), norm-gate weight and bias, and output gradient."""
    pre = torch.randn(rows, heads * 4 * dim, generator=gen, requires_grad=True)
    weight, bias = torch.randn(heads * dim, generator=gen), torch.randn(heads * dim, generator=gen)
    return pre, weight, bias, torch.randn(rows, heads * dim, generator=gen)


def gap_grad(leaves, offsets, heads, dim, max_len, mode, extras=NO_EXTRAS) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """The gap's gradient in its pre-activation with ``dq_mode=mode``."""
    pre, weight, bias, dy = leaves
    y, _ = hstu_gap_triton(pre, weight, bias, offsets, num_heads=heads, attention_dim=dim, value_dim=dim,
                           max_seq_len=max_len, alpha=1 / math.sqrt(dim), eps=1e-5, dq_mode=mode, extras=extras)  # fmt: skip
    return torch.autograd.grad(y, pre, dy)[0]


def test_the_key_major_pass_stores_every_allowed_pair_where_the_layout_says(gen, monkeypatch) -> None:
    """Every allowed pair's ``ds`` at its tile's row and column (rows counted out here, not by the module's
    formula), across chunk borders of the in-kernel scan, an empty sequence and lengths off the tile grid."""
    monkeypatch.setattr(attention_triton_bwd, "CHUNK", 4)
    lengths = [70, 0, 33, *torch.randint(1, 100, (3,), generator=gen).tolist(), 129]
    heads, dim, alpha = 2, 16, 0.25
    targets = torch.minimum(torch.randint(0, 4, (len(lengths),), generator=gen), torch.tensor(lengths))
    offsets = offsets_from_lengths(lengths)
    q, k, v = random_qkv(int(offsets[-1]), heads, dim, dim, torch.float32, gen)
    g = torch.randn(q.shape, generator=gen)
    plan = prepare(offsets, heads)
    rows = tile_rows(lengths, heads)
    per_seq = [sum(1 for key in rows if key[0] == b) for b in range(len(lengths))]
    assert plan.tiles() == len(rows) and plan.base_for(heads).tolist() == [sum(per_seq[:b]) for b in range(len(lengths))]
    stored = plan.scores(torch.float32)
    assert stored is not None and stored.buffer.shape == ((len(rows) + 1) * 32, 64)
    need = plan.buffer_bytes(torch.float32)
    assert need == stored.buffer.numel() * 4  # what scores() checks against the budget is what it allocates
    assert plan.scores(torch.float32, budget_bytes=need) is not None
    one_head = plan.scores(torch.float32, need - 1)  # the heads one at a time
    assert one_head is not None and one_head.heads == 1
    assert one_head.buffer.numel() * 4 == plan.buffer_bytes(torch.float32, 1)
    assert plan.scores(torch.float32, plan.buffer_bytes(torch.float32, 1) - 1) is None
    key_major(q, k, v, g, offsets, targets, None, max_seq_len=max(lengths), alpha=alpha, max_attn_len=0,
              stored=stored)  # fmt: skip
    want = expected_ds(q, k, v, g, lengths, targets, alpha)
    mask = attention_mask(torch.tensor(lengths), targets, 0, max(lengths))
    checked = 0
    for b, n in enumerate(lengths):
        for h in range(heads):
            for i, j in torch.nonzero(mask[b, :n, :n]).tolist():
                got = stored.buffer[rows[b, h, j // 64, i // 32] + i % 32, j % 64]
                torch.testing.assert_close(got.double(), want[b][h, i, j], rtol=1e-5, atol=1e-6)
                checked += 1
    assert checked == int(mask.sum()) * heads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_targets", [False, True])
def test_dq_from_stored_tiles_is_the_recomputed_dq(gen, monkeypatch, dtype, with_targets) -> None:
    """``dq`` from the stored tiles equals the separate pass's (the same ``ds``, summed in another order);
    storing changes nothing in ``dk`` and ``dv``; unwritten tiles (NaN) are never added."""
    monkeypatch.setattr(attention_stored, "CHUNK", 4)
    lengths = [*torch.randint(1, 140, (5,), generator=gen).tolist(), 64, 97]
    heads, dim, max_len, alpha = 2, 64, 140, 0.2
    offsets = offsets_from_lengths(lengths)
    targets = torch.minimum(torch.randint(1, 4, (len(lengths),), generator=gen), torch.tensor(lengths))
    targets = targets if with_targets else None
    q, k, v = random_qkv(int(offsets[-1]), heads, dim, dim, dtype, gen)
    g = torch.randn(q.shape, generator=gen).to(dtype)
    options = dict(max_seq_len=max_len, alpha=alpha, max_attn_len=0)
    dk0, dv0 = key_major(q, k, v, g, offsets, targets, None, **options)
    dq0 = query_major(q, k, v, g, offsets, targets, **options)
    stored = prepare(offsets, heads).scores(dtype)
    assert stored is not None
    dk, dv = key_major(q, k, v, g, offsets, targets, None, stored=stored, **options)
    dq = dq_from_stored(stored, k, offsets, targets, max_seq_len=max_len, alpha=alpha, out=torch.empty_like(q))
    assert torch.equal(dk, dk0) and torch.equal(dv, dv0)
    assert not dq.isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(dq.float(), dq0.float(), rtol=tolerance, atol=tolerance * dq0.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_targets", [False, True])
def test_dq_from_stored_adds_only_the_allowed_pairs_of_its_tiles(gen, monkeypatch, dtype, with_targets) -> None:
    """Each tile written by hand (rows counted out by :func:`tile_rows`), with NaN in every pair the mask forbids
    and in the spare tile: ``dq`` is ``scale * ds k`` of the allowed pairs. Lengths: shorter than 32, off the 32
    and 64 grids, several programs (300), an empty sequence, and last 129, whose last block of 64 reads its
    second tile from the spare tile past the last one (pointer loads in float32, tensor descriptors in bf16)."""
    monkeypatch.setattr(attention_stored, "CHUNK", 4)
    lengths = [17, 300, 0, 96, *torch.randint(1, 200, (2,), generator=gen).tolist(), 129]
    heads, dim, max_len, alpha = 2, 64, 300, 0.3
    offsets = offsets_from_lengths(lengths)
    targets = torch.minimum(torch.randint(1, 40, (len(lengths),), generator=gen), torch.tensor(lengths))
    targets = targets if with_targets else None
    mask = attention_mask(torch.tensor(lengths), targets, 0, max_len)
    k = torch.randn(int(offsets[-1]), heads, dim, generator=gen).to(dtype)
    plan = prepare(offsets, heads)
    stored = plan.scores(dtype)
    assert stored is not None and stored.buffer.isnan().all()
    want = torch.zeros(k.shape, dtype=torch.float64)
    padded = []  # per sequence [H, 32 Qb, 64 Kb]: NaN in every pair the mask forbids (never written)
    for b, n in enumerate(lengths):
        a, allowed = int(offsets[b]), mask[b, :n, :n].bool()
        ds = torch.randn(heads, n, n, generator=gen).to(dtype)
        want[a : a + n] = torch.einsum("hij,jhd->ihd", torch.where(allowed, ds, 0).double(), k[a : a + n].double())
        padded.append(torch.full((heads, -(-n // 32) * 32, -(-n // 64) * 64), math.nan, dtype=dtype))
        padded[b][:, :n, :n] = torch.where(allowed, ds, math.nan)
    want *= alpha / max_len
    rows = tile_rows(lengths, heads)
    for (b, h, j, i), at in rows.items():
        stored.buffer[at : at + 32] = padded[b][h, 32 * i : 32 * i + 32, 64 * j : 64 * j + 64]
    assert len(rows) == plan.tiles() and stored.buffer.shape[0] == (len(rows) + 1) * 32
    assert stored.buffer[len(rows) * 32 :].isnan().all()  # the spare tile
    dq = dq_from_stored(stored, k, offsets, targets, max_seq_len=max_len, alpha=alpha, out=torch.empty_like(k))
    assert not dq.isnan().any()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(dq.double(), want, rtol=tolerance, atol=tolerance * want.abs().max().item())


def test_the_autograd_function_and_the_fused_gap_take_stored_dq(gen, monkeypatch) -> None:
    """Through autograd: the attention's and the HSTU gap's gradients with ``dq_mode="stored"`` are those of
    ``separate``; past the budget the call recomputes (no buffer), with the same gradients."""
    lengths = [45, 80, 3]
    heads, dim = 2, 64
    offsets = offsets_from_lengths(lengths)
    rows = int(offsets[-1])
    qkvg = attention_leaves(gen, rows, heads, dim)
    grads = {mode: attention_grads(qkvg, offsets, 80, mode) for mode in ("separate", "stored")}
    for a, b in zip(grads["separate"], grads["stored"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    leaves = gap_leaves(gen, rows, heads, dim)
    extras = AttentionExtras(num_targets=torch.tensor([1, 2, 0]))
    gap = {}
    allocated: list[int] = []
    real = attention_stored.ScorePlan.scores
    monkeypatch.setattr(attention_stored.ScorePlan, "scores",
                        lambda self, *a, **kw: allocated.append(1) or real(self, *a, **kw))  # fmt: skip
    for mode, budget in (("separate", None), ("stored", None), ("stored", 0)):
        if budget is not None:
            monkeypatch.setattr(attention_stored, "BUDGET_BYTES", budget)
        gap[mode, budget] = gap_grad(leaves, offsets, heads, dim, 80, mode, extras)
    assert len(allocated) == 2  # stored asked for a buffer twice: one made, one over the budget
    torch.testing.assert_close(gap["stored", None], gap["separate", None], rtol=1e-5, atol=1e-5)
    assert torch.equal(gap["stored", 0], gap["separate", None])  # over the budget: the separate pass itself


def test_a_buffer_holds_the_most_heads_that_fit_the_budget() -> None:
    """Head groups: the most heads, a divisor of the head count, whose tiles fit; each sequence's first tile in a
    buffer of that many heads; none when not even one head fits."""
    offsets = offsets_from_lengths([3, 70, 129])
    plan = prepare(offsets, 6)
    per_head = 1 + (2 * 3 - 2) + (3 * 5 - 6)  # c(n) = Kb Qb - Kb (Kb - 1)
    assert plan.tiles_per_head() == per_head and plan.tiles() == 6 * per_head and plan.tiles(2) == 2 * per_head
    one = plan.buffer_bytes(torch.bfloat16, 1)
    assert one == (per_head + 1) * 32 * 64 * 2
    for budget, heads in ((plan.buffer_bytes(torch.bfloat16), 6), (plan.buffer_bytes(torch.bfloat16) - 1, 3),
                          (plan.buffer_bytes(torch.bfloat16, 3) - 1, 2), (plan.buffer_bytes(torch.bfloat16, 2) - 1, 1),
                          (one - 1, 0)):  # fmt: skip
        assert plan.group_heads(torch.bfloat16, budget) == heads, budget
        stored = plan.scores(torch.bfloat16, budget)
        if heads == 0:
            assert stored is None
            continue
        assert stored is not None and stored.heads == heads
        assert stored.buffer.shape == ((heads * per_head + 1) * 32, 64)
        assert stored.base.tolist() == [0, heads * 1, heads * (1 + 4)]


def test_a_budget_short_of_every_head_stores_a_group_of_heads_at_a_time(gen, monkeypatch) -> None:
    """Through autograd and the fused gap, with a budget that fits one head of two: one buffer, the passes run
    once per head, and the gradients are those of ``separate`` (unwritten tiles NaN)."""
    lengths = [45, 130, 3]
    heads, dim, heads_fit = 2, 64, 1
    offsets = offsets_from_lengths(lengths)
    rows = int(offsets[-1])
    budget = prepare(offsets, heads).buffer_bytes(torch.float32, heads_fit)
    monkeypatch.setattr(attention_stored, "BUDGET_BYTES", budget)
    calls: list[tuple[int, int]] = []
    real_key_major, real_dq = attention_triton_autograd.key_major, attention_stored.dq_from_stored

    def counted_key_major(q, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(("key_major", q.shape[1]))
        return real_key_major(q, *args, **kwargs)

    def counted_dq(stored, k, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(("dq", stored.heads))
        return real_dq(stored, k, *args, **kwargs)

    monkeypatch.setattr(attention_triton_autograd, "key_major", counted_key_major)
    monkeypatch.setattr(attention_stored, "dq_from_stored", counted_dq)
    qkvg = attention_leaves(gen, rows, heads, dim)
    grads = {}
    for mode in ("separate", "stored"):
        calls.clear()
        grads[mode] = attention_grads(qkvg, offsets, 130, mode)
    groups = heads // heads_fit
    assert calls == [("key_major", heads_fit), ("dq", heads_fit)] * groups
    for a, b in zip(grads["separate"], grads["stored"], strict=True):
        assert not b.isnan().any()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    leaves = gap_leaves(gen, rows, heads, dim)
    gap = {}
    for mode in ("separate", "stored"):
        calls.clear()
        gap[mode] = gap_grad(leaves, offsets, heads, dim, 130, mode)
    assert calls == [("key_major", heads_fit), ("dq", heads_fit)] * groups
    torch.testing.assert_close(gap["stored"], gap["separate"], rtol=1e-5, atol=1e-5)


def test_the_plan_is_shared_by_one_batch_and_remade_for_another() -> None:
    offsets = offsets_from_lengths([3, 70])
    plan = prepare(offsets, 2)
    assert prepare(offsets, 2) is plan and plan.tiles() == 2 * (1 + 4)
    assert prepare(offsets, 1) is not plan  # another head count
    offsets[2] = 66  # changed in place: a new plan, with the new lengths
    assert prepare(offsets, 1).tiles() == 1 + 2 and prepare(offsets_from_lengths([3, 70]), 1) is not plan
    assert attention_stored.ScorePlan(offsets_from_lengths([]), 4).tiles() == 0


def test_refusals() -> None:
    """Stored tiles only where they are written: no window or bias in the key-major pass, 64-key tiles of
    32-query steps in the Gluon pass; the dq pass's shapes."""
    q = torch.zeros(8, 1, 64)
    offsets = torch.tensor([0, 8])
    stored = StoredScores(torch.zeros(64, 64), torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="without atomic dq, relative biases or a window"):
        key_major(q, q, q, q, offsets, None, None, max_seq_len=8, alpha=1.0, max_attn_len=3, stored=stored)
    with pytest.raises(ValueError, match="not config 'ws_n128m16'"):
        attention_gluon.dkdv(q, q, q, q, offsets, None, max_seq_len=8, alpha=1.0, config="ws_n128m16", stored=stored)
    with pytest.raises(ValueError, match="not config 'n128m32'"):
        attention_gluon.dkdv(q, q, q, q, offsets, None, max_seq_len=8, alpha=1.0, config="n128m32", stored=stored)
    with pytest.raises(ValueError, match="D in"):
        dq_from_stored(
            stored, torch.zeros(8, 1, 32), offsets, None, max_seq_len=8, alpha=1.0, out=torch.zeros(8, 1, 32)
        )
    assert attention_stored.applies(q, q, NO_BIAS, 0) and not attention_stored.applies(q, q, NO_BIAS, 3)
    assert not attention_stored.applies(torch.zeros(8, 1, 32), torch.zeros(8, 1, 32), NO_BIAS, 0)


COMPILE = """
import json
from gem_kernels.compile_report import compile_gluon_forward
for store in (False, True):
    print(json.dumps({"store": store, **compile_gluon_forward("n64m32", dkdv=True, store_ds=store)}))
"""


def test_the_gluon_pass_that_stores_its_tiles_compiles_for_hopper_and_still_fits_twice_an_sm() -> None:
    """The shipped dk/dv pass (``n64m32``) built for sm_90 with and without its ``ds`` stores: the stores add
    one bulk tensor copy and one ``[32, 64]`` slot pair of shared memory (8 KiB), and the build still fits two
    programs an SM with at most 24 bytes of spills (none in Triton 3.6's build, 8 without the stores and 24
    with them in 3.7's). A step's tile is stored once its MMAs have all been waited for: storing it between
    the next step's score MMAs and its accumulating ones was measured slower (H100, 2026-12-07:
    ``benchmarks/results/jagged_attention.md``)."""
    pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    plain, storing = (json.loads(line) for line in result.stdout.splitlines() if line.startswith("{"))
    assert storing["shared_bytes"] - plain["shared_bytes"] == 2 * 32 * 64 * 2, (plain, storing)
    assert storing["tma_loads"] > plain["tma_loads"]  # the bulk tensor store (counted with the copies)
    assert storing["fit_per_sm"] >= 2 and storing["stack_bytes"] <= 24, storing
    assert storing["async_mmas"] == plain["async_mmas"] and storing["mma_waits"] == plain["mma_waits"], storing
    assert "store" not in plain["mma_order"], plain["mma_order"]
    assert follows(storing["mma_order"], ["wait0", "store"]), storing["mma_order"]
    assert not follows(storing["mma_order"], ["64x32", "store"]), storing["mma_order"]
