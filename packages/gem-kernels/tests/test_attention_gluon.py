"""The Gluon Hopper forward (gem_kernels.attention_gluon). Gluon has no interpreter, so on the CPU it is
compiled for sm_90 (in a subprocess without ``TRITON_INTERPRET``) and its schedule read from the PTX;
its numbers against the Triton forward are ``benchmarks/attention_gluon.py``'s, on the GPU. Here also:
what routes a call to it, and its argument checks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")

from gem_kernels import attention_gluon, attention_triton
from gem_kernels.attention_triton import query_major
from gem_kernels.compile_report import follows

HOPPER_SHARED_LIMIT = 227 * 1024
SCRIPT = """
import json
from gem_kernels.compile_report import compile_gluon_forward
for config, dims, targets in (("m128n64", (128, 128), True), ("m64n64", (128, 128), True), ("m64n64", (64, 64), False),
                              ("ws_m128n64", (128, 128), True), ("ws_m128n128", (128, 128), False)):
    print(json.dumps({"config": config, "dims": dims, **compile_gluon_forward(config, *dims, targets=targets)}))
print(json.dumps({"config": "dq", "dims": [128, 128], **compile_gluon_forward("m128n64", dq=True)}))
print(json.dumps({"config": "dkdv", "dims": [128, 128], **compile_gluon_forward("n128m32", dkdv=True)}))
print(json.dumps({"config": "dkdv_ws", "dims": [128, 128], **compile_gluon_forward("ws_n128m16", dkdv=True)}))
print(json.dumps({"config": "dq_ws", "dims": [128, 128], **compile_gluon_forward("ws_m128n32", dq=True)}))
for config in ("m64n32", "qr_m64n32", "m64n16"):
    print(json.dumps({"config": config, "dims": [128, 128], **compile_gluon_forward(config)}))
for config in ("m64n32s2", "m64n16"):
    print(json.dumps({"config": "dq_" + config, "dims": [128, 128], **compile_gluon_forward(config, dq=True)}))
for config in ("n64m32", "n64m16"):
    print(json.dumps({"config": "dkdv_" + config, "dims": [128, 128], **compile_gluon_forward(config, dkdv=True)}))
for config in ("m64n32p2", "m64n32s2p2"):
    print(json.dumps({"config": "dq_" + config, "dims": [128, 128], **compile_gluon_forward(config, dq=True)}))
"""


def test_the_forward_compiles_for_hopper_with_its_schedule() -> None:
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 18
    # every config launches no more programs an SM than its registers and shared memory let in
    assert all(r["fit_per_sm"] >= r["programs_per_sm"] for r in reports), [
        (r["config"], r["fit_per_sm"], r["programs_per_sm"]) for r in reports]
    # the dq pass as the dk/dv pass runs: one warpgroup, 32 keys a step, two programs an SM without a
    # register cap and without spills, ds k left in flight while the next step's scores are computed
    for r in (reports.pop(), reports.pop()):
        assert r["programs_per_sm"] == 2 and r["register_cap"] is None and r["stack_bytes"] == 0, r
        assert 2 * r["shared_bytes"] <= 228 * 1024 and r["mma_waits"].get("1") == 1, r
        assert follows(r["mma_order"], ["64x32", "64x32", "64x128", "wait1"]), r["mma_order"]
    # the dk/dv pass in one warpgroup of 64 keys, two programs an SM: no spills at 16-query steps, at most
    # 8 bytes at 32 (none in Triton 3.6's build, 8 in 3.7's), dk and dv accumulating over the step's two
    # MMAs while the next step's scores are computed (wait_group 2)
    for r in (reports.pop(), reports.pop()):
        assert r["programs_per_sm"] == 2 and r["register_cap"] is None, r
        assert r["stack_bytes"] <= (8 if r["config"] == "dkdv_n64m32" else 0), r
        assert r["mma_waits"].get("2") == 1 and follows(r["mma_order"], ["64x128", "64x128", "wait2"]), r
    three = {r["config"]: r for r in reports[-5:]}
    del reports[-5:]
    # three programs an SM, as the Triton forward's best: registers capped at 168 (three of 4 warps in
    # 65,536), 64 KiB of shared memory or less; the forward without spills, the queries in registers too
    # (qr_m64n32: q k^T from registers), the dq pass's 16-key blocks without, its 32-key blocks 32 bytes
    assert all(r["register_cap"] == 168 and r["registers"] <= 168 and r["fit_per_sm"] >= 3 for r in three.values()), three
    assert all(r["shared_bytes"] <= 66 * 1024 for r in three.values()), three
    for config in ("m64n32", "qr_m64n32", "m64n16", "dq_m64n16"):
        assert three[config]["stack_bytes"] == 0, three[config]
    assert three["dq_m64n32s2"]["stack_bytes"] <= 32, three["dq_m64n32s2"]
    assert three["qr_m64n32"]["registers"] > three["m64n32"]["registers"] + 16  # the 64 x 128 queries: 32 a thread
    for config in ("m64n32", "qr_m64n32", "m64n16"):
        assert follows(three[config]["mma_order"], ["64x" + config[-2:], "64x128", "wait1"]), three[config]["mma_order"]
    dq_ws = reports.pop()
    assert dq_ws["stack_bytes"] == 0 and dq_ws["arrives_after_barrier"], dq_ws
    assert follows(dq_ws["mma_order"], ["64x32", "64x32", "64x128", "wait1"]), dq_ws["mma_order"]
    dkdv_ws = reports.pop()
    # the dk/dv pass with a producer warp: no spills at 16-query steps in the consumers' 240 registers
    assert dkdv_ws["stack_bytes"] == 0 and 240 in dkdv_ws["setmaxnreg"] and dkdv_ws["mma_waits"].get("2") == 1, dkdv_ws
    dkdv = reports.pop()
    # the dk/dv pass: four MMAs a step, one wait leaving the two accumulating ones in flight
    assert dkdv["mma_waits"].get("2") == 1 and dkdv["stack_bytes"] <= 8 and dkdv["tma_loads"] >= 4, dkdv
    assert dkdv["shared_bytes"] <= HOPPER_SHARED_LIMIT, dkdv
    dq = reports.pop()
    # the dq pass: three MMAs a step (q k^T, g v^T, ds k), one wait leaving ds k in flight; at 255
    # registers its 64-key blocks spill 8-16 bytes (attention_gluon.DQ_CONFIGS)
    assert dq["async_mmas"] > reports[0]["async_mmas"] and dq["mma_waits"].get("1") == 1, dq
    assert dq["stack_bytes"] <= 16 and dq["shared_bytes"] <= HOPPER_SHARED_LIMIT and dq["tma_loads"] >= 4, dq
    for r in reports:
        assert r["shared_bytes"] <= HOPPER_SHARED_LIMIT and r["stack_bytes"] == 0, r  # no spills
        # the schedule: one wait that leaves the previous P v in flight (wgmma.wait_group 1) while the
        # silu runs, the others drain (0); K, V and q come by bulk tensor copies; the silu by tanh.approx
        assert r["mma_waits"].get("1") == 1 and r["mma_waits"].get("0", 0) >= 2, r
        assert r["tma_loads"] >= 3 and r["tanh_approx"], r
        assert r["narrow_loads"] == 0 and r["narrow_stores"] == 0, r
    m64 = next(r for r in reports if r["config"] == "m64n64" and r["dims"] == [128, 128])
    # two programs an SM, as CONFIGS launches it
    assert 2 * m64["shared_bytes"] <= 228 * 1024, m64
    # the producer warp: registers handed from it (40 -> 24) to the consumer warpgroups (240); no TMA
    # issue left among the math warps, so fewer barriers than the one-partition build's
    one, ws = (next(r for r in reports if r["config"] == c) for c in ("m128n64", "ws_m128n64"))
    assert 240 in ws["setmaxnreg"] and 24 in ws["setmaxnreg"] and one["setmaxnreg"] == [], ws
    assert ws["barriers"] < one["barriers"], (ws, one)
    # the loop's issue order: the scores' group (m64 n64: q k^T over 64 keys), then P v's (n128: the
    # head dim), then the wait that leaves P v in flight; and a slot is handed back to the producer only
    # after a barrier of the consumer warps (the other warpgroup's MMAs are done with it)
    for r in (one, ws):
        assert follows(r["mma_order"], ["64x64", "64x128", "wait1"]), r["mma_order"]
    assert ws["arrives_after_barrier"] and dkdv_ws["arrives_after_barrier"], (ws, dkdv_ws)
    assert follows(dq["mma_order"], ["64x64", "64x64", "64x128", "wait1"]), dq["mma_order"]
    assert follows(dkdv["mma_order"], ["64x32", "64x32", "64x128", "64x128", "wait2"]), dkdv["mma_order"]


def test_supported_wants_a_hopper_gpu_and_a_two_dimensional_view() -> None:
    q = torch.zeros(8, 2, 128, dtype=torch.bfloat16)
    assert not attention_gluon.supported(q, q, q)  # a CPU tensor: no sm_90


def test_forward_names_an_unknown_config() -> None:
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 3, 8])
    with pytest.raises(ValueError, match=r"config 'm256n256' is not one of"):
        attention_gluon.forward(q, q, q, offsets, None, max_seq_len=8, alpha=0.1, config="m256n256")


def test_query_major_keeps_the_triton_kernel_where_gluon_does_not_apply(monkeypatch, gen) -> None:
    """With the switch on, a call the Gluon kernel cannot take (here: not on an sm_90 GPU) runs the Triton
    forward, with the same result as with the switch off."""
    calls: list[object] = []
    monkeypatch.setattr(attention_gluon, "forward", lambda *a, **k: calls.append(a))
    lengths = [5, 0, 9]
    offsets = torch.tensor([0, 5, 5, 14])
    q, k, v = (torch.randn(sum(lengths), 2, 16, generator=gen).to(torch.bfloat16) for _ in range(3))
    options = dict(max_seq_len=9, alpha=0.25, max_attn_len=0)
    monkeypatch.setattr(attention_gluon, "FORWARD", False)
    off = query_major(q, k, v, None, offsets, None, **options)
    monkeypatch.setattr(attention_gluon, "FORWARD", True)
    on = query_major(q, k, v, None, offsets, None, **options)
    assert not calls and torch.equal(off, on)
    # and where it applies, the call goes there, with the caller's arguments
    monkeypatch.setattr(attention_gluon, "supported", lambda *tensors: True)
    query_major(q, k, v, None, offsets, None, **options)
    assert len(calls) == 1 and calls[0][0] is q
    # never for the dq pass (unless attention_gluon.DQ), a window or set tiles
    calls.clear()
    query_major(q, k, v, q, offsets, None, **options)
    query_major(q, k, v, None, offsets, None, max_seq_len=9, alpha=0.25, max_attn_len=3)
    query_major(q, k, v, None, offsets, None, blocks=(16, 16), **options)
    assert not calls
    assert attention_triton.attention_gluon is attention_gluon


def test_query_major_sends_the_dq_pass_to_gluon_only_when_asked(monkeypatch, gen) -> None:
    calls: list[tuple] = []
    monkeypatch.setattr(attention_gluon, "dq", lambda *a, **k: calls.append(a))
    monkeypatch.setattr(attention_gluon, "supported", lambda *tensors: True)
    offsets = torch.tensor([0, 6, 13])
    q, k, v, g = (torch.randn(13, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(4))
    options = dict(max_seq_len=7, alpha=0.25, max_attn_len=0)
    monkeypatch.setattr(attention_gluon, "DQ", False)
    expected = query_major(q, k, v, g, offsets, None, **options)
    assert not calls and expected.shape == q.shape
    monkeypatch.setattr(attention_gluon, "DQ", True)
    query_major(q, k, v, g, offsets, None, **options)
    assert len(calls) == 1 and calls[0][3] is g
    query_major(q, k, v, None, offsets, None, **options)  # the forward is FORWARD's
    assert len(calls) == 1


def test_dq_names_an_unknown_config() -> None:
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"config 'm128n128' is not one of"):
        attention_gluon.dq(q, q, q, q, torch.tensor([0, 8]), None, max_seq_len=8, alpha=0.1, config="m128n128")


def test_key_major_sends_dk_dv_to_gluon_only_when_asked(monkeypatch, gen) -> None:
    from gem_kernels.attention_triton_bias import BiasGrads
    from gem_kernels.attention_triton_bwd import key_major

    calls: list[tuple] = []
    monkeypatch.setattr(attention_gluon, "dkdv", lambda *a, **k: calls.append(a) or (a[1], a[2]))
    monkeypatch.setattr(attention_gluon, "supported", lambda *tensors: True)
    offsets = torch.tensor([0, 6, 13])
    q, k, v, g = (torch.randn(13, 2, 16, generator=gen).to(torch.bfloat16) for _ in range(4))
    options = dict(max_seq_len=7, alpha=0.25, max_attn_len=0)
    monkeypatch.setattr(attention_gluon, "DKDV", False)
    dk, dv = key_major(q, k, v, g, offsets, None, None, **options)
    assert not calls and dk.shape == k.shape and dv.shape == v.shape
    monkeypatch.setattr(attention_gluon, "DKDV", True)
    key_major(q, k, v, g, offsets, None, None, bias_grads=BiasGrads(None, None), **options)  # the gap's call
    assert len(calls) == 1 and calls[0][3] is g
    # not with atomic dq (the Gluon pass has none)
    key_major(q, k, v, g, offsets, None, torch.zeros(13, 2, 16), **options)
    assert len(calls) == 1


def test_a_grid_of_no_program_is_refused() -> None:
    q = torch.zeros(8, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="programs must be at least 1, got 0"):
        attention_gluon.forward(q, q, q, torch.tensor([0, 8]), None, max_seq_len=8, alpha=0.1, programs=0)


@pytest.mark.parametrize("which", ["forward", "forward_qr", "ws", "dq", "dq3", "dq_ws", "dkdv", "dkdv_default", "dkdv_ws",
                                   "dkdv_stored"])
def test_each_launcher_binds_its_kernels_signature(monkeypatch, gen, which) -> None:
    """The launchers never run on the CPU; here each kernel is replaced by a recorder, and what the
    launcher hands it must bind to the kernel's own parameters (names, count, constexprs), with the
    scales and grid as asked."""
    import inspect

    from gem_kernels import attention_gluon_dkdv, attention_gluon_dq, attention_gluon_fwd, attention_gluon_ws

    module, name = {"forward": (attention_gluon_fwd, "forward_kernel"), "ws": (attention_gluon_ws, "forward_ws_kernel"),
                    "forward_qr": (attention_gluon_fwd, "forward_kernel"), "dq3": (attention_gluon_dq, "dq_kernel"),
                    "dq": (attention_gluon_dq, "dq_kernel"), "dq_ws": (attention_gluon_dq, "dq_ws_kernel"),
                    "dkdv": (attention_gluon_dkdv, "dkdv_kernel"), "dkdv_default": (attention_gluon_dkdv, "dkdv_kernel"),
                    "dkdv_ws": (attention_gluon_dkdv, "dkdv_ws_kernel"),
                    "dkdv_stored": (attention_gluon_dkdv, "dkdv_kernel")}[which]
    real = getattr(module, name)
    calls: list[tuple] = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: calls.append((grid, args, kwargs))

    monkeypatch.setattr(module, name, Recorder())
    q, k, v, g = (torch.randn(40, 2, 64, generator=gen).to(torch.bfloat16) for _ in range(4))
    offsets, targets = torch.tensor([0, 15, 15, 40]), torch.tensor([2, 0, 1])
    options = dict(max_seq_len=25, alpha=0.5, programs=3)
    config = {"forward": "m64n64", "forward_qr": "qr_m64n32", "ws": "ws_m128n64", "dq": "m64n64", "dq3": "m64n32s2",
              "dq_ws": "ws_m128n32"}.get(which)  # fmt: skip
    if which in ("forward", "forward_qr", "ws"):
        attention_gluon.forward(q, k, v, offsets, targets, config=config, **options)
    elif which in ("dq", "dq3", "dq_ws"):
        attention_gluon.dq(q, k, v, g, offsets, targets, config=config, **options)
    else:
        # dkdv_default: the shipped config (DEFAULT_DKDV_CONFIG, two programs an SM); dkdv_stored: it, storing ds
        from gem_kernels.attention_stored import StoredScores

        config = {"dkdv_ws": "ws_n128m16", "dkdv": "n128m32"}.get(which)
        stored = StoredScores(torch.empty(96, 64, dtype=torch.bfloat16), torch.tensor([0, 4, 4]))
        attention_gluon.dkdv(q, k, v, g, offsets, targets, config=config,
                             stored=stored if which == "dkdv_stored" else None, **options)  # fmt: skip
    (grid, args, kwargs), = calls
    assert grid == (3,)
    launch = {key: kwargs.pop(key) for key in ("num_warps", "maxnreg") if key in kwargs}
    bound = inspect.signature(real.fn).bind(*args, **kwargs)  # raises on a missing, extra or misplaced argument
    values = bound.arguments
    assert values["half_alpha"] == 0.25 and values["num_seqs"] == 3 and values["num_heads"] == 2
    assert values["SEQ_OFFSETS"] is offsets and values["NUM_TARGETS"] is targets and values["HAS_TARGETS"] is True
    scale = {"forward": ("out_scale", 1 / 25), "forward_qr": ("out_scale", 1 / 25), "ws": ("out_scale", 1 / 25),
             "dq": ("out_scale", 0.5 / 25), "dq3": ("out_scale", 0.5 / 25), "dq_ws": ("out_scale", 0.5 / 25),
             "dkdv": ("dk_scale", 0.5 / 25), "dkdv_default": ("dk_scale", 0.5 / 25), "dkdv_ws": ("dv_scale", 1 / 25),
             "dkdv_stored": ("dk_scale", 0.5 / 25)}[which]
    assert values[scale[0]] == pytest.approx(scale[1])
    assert launch["num_warps"] in (4, 8)
    if which in ("dkdv_default", "dkdv_stored"):  # n64m32: one warpgroup of 64 keys, two programs an SM
        assert launch["num_warps"] == 4 and values["BLOCK_N"] == 64 and values["BLOCK_M"] == 32, (launch, values)
        # the ds tiles' descriptor ([32, 64] blocks of the buffer) and bases only when storing
        assert values["STORE_DS"] is (which == "dkdv_stored"), values
        if which == "dkdv_stored":
            assert values["ds_desc"].block_shape == [32, 64] and values["DS_BASE"] is stored.base
    # three programs of 4 warps an SM: registers capped so that they fit; the others need no cap
    assert launch.get("maxnreg") == (168 if which in ("forward_qr", "dq3") else None), launch
    if which in ("forward", "forward_qr"):
        assert values["QUERY_REGS"] is (which == "forward_qr")


@pytest.mark.parametrize(("warps", "per_sm", "cap"), [(4, 1, None), (4, 2, None), (4, 3, 168), (4, 4, 128), (8, 1, None),
                                                      (8, 2, 128)])
def test_the_register_cap_lets_the_programs_an_sm_fit(warps, per_sm, cap) -> None:
    assert attention_gluon.register_cap(warps, per_sm) == cap
    if cap is not None:
        assert per_sm * warps * 32 * cap <= attention_gluon.REGISTER_FILE < per_sm * warps * 32 * (cap + 8)


def test_programs_fitting_counts_registers_in_eights_and_shared_memory_with_its_reserve() -> None:
    from gem_kernels.compile_report import programs_fitting

    assert programs_fitting(154, 66560, 4) == 3  # the Triton forward's best (64 x 32, 3 stages)
    assert programs_fitting(179, 82072, 4) == 2  # Gluon m64n64: 184 registers a thread as allocated
    assert programs_fitting(170, 1024, 4) == 2  # 176 as allocated: not three
    assert programs_fitting(119, 49304, 4) == 4  # registers allow 4; shared memory 4 (49 KiB + 1 KiB each)
    assert programs_fitting(64, 76 * 1024, 4) == 2  # shared memory alone: 3 x 77 KiB > 228 KiB
    assert programs_fitting(32, 1024, 4) == 16  # at most 64 warps an SM
    assert programs_fitting(None, 1024, 4) is None
