"""The attention rows of ``kernel_energy.py``: the three passes as shipped, each pass at each candidate config,
the fp8 forward, and the whole backward in its three forms, each checked before it is measured (the module
docstring of ``kernel_energy.py`` lists the rows)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_gluon import MMAS, check, gluon_pass, make_inputs, triton_pass  # beside this script
from energy_kernel import Kernel, refuse_if_wrong  # beside this script

ATTENTION_TOLERANCE = 1e-2
"""The shipped passes are ~2.3e-3 from float64 on the first sequences (bf16 inputs and outputs)."""


def attention_kernels(seed: int, device: torch.device, *, configs: bool = True) -> tuple[dict[str, Kernel], int]:
    """The attention rows; ``configs``: with each pass's pinned configs (:func:`attention_configs`, which
    compiles, runs and checks every candidate first)."""
    x = make_inputs("big_config", seed, device)
    for which in ("forward", "dq", "dkdv"):
        error = check(x, which, [], 2e-2)["against_float64"]["triton"]
        if not error <= ATTENTION_TOLERANCE:
            raise SystemExit(
                f"attention {which}: {error:.3g} from float64 (limit {ATTENTION_TOLERANCE}), refusing to measure it"
            )
    case = x["case"]
    forward_flops = 2.0 * case.heads * 2 * case.dim * x["squares"] / 2
    out = {"forward": (torch.empty_like(x["q"]),), "dq": (torch.empty_like(x["q"]),),
           "dkdv": (torch.empty_like(x["k"]), torch.empty_like(x["v"]))}  # fmt: skip
    kernels = {f"attention_{w}": Kernel(lambda w=w: triton_pass(x, w, out[w]), forward_flops * MMAS[w] / 2)
               for w in ("forward", "dq", "dkdv")}  # fmt: skip
    if configs:
        kernels.update(attention_configs(x, forward_flops, out))
    kernels.update(attention_backwards(x, forward_flops))
    kernels.update(attention_forward_fp8(x, forward_flops, out["forward"][0]))
    return kernels, int(x["q"].shape[0])


def _config_name(config: tuple[int, ...]) -> str:
    return "x".join(map(str, config))


def attention_configs(x: dict[str, Any], forward_flops: float, out: dict[str, tuple[torch.Tensor, ...]], *,
                      tables: dict[str, list[tuple[int, ...]]] | None = None, dkdv: bool = True) -> dict[str, Kernel]:  # fmt: skip
    """Every candidate config of each attention pass, pinned: ``attention_forward@BMxBNxWxSxP`` and
    ``attention_dq@...`` (the Triton passes' ``FORWARD_CONFIGS`` and ``DQ_CONFIGS``), ``attention_dkdv@NAME``
    (the Gluon pass's ``DKDV_CONFIGS``). The tuner picks by the time of short runs, where the card is not
    yet at its power cap; these rows give each config's energy at the cap. A pinned call puts the tuner's
    pick back as soon as it has launched, so no other row runs a pinned config. Each pinned config is
    checked against the tuned one's output first. ``tables`` replaces
    the Triton passes' candidates (the CPU test's, which the interpreter can run); ``dkdv=False`` leaves the
    Gluon pass out."""
    from gem_kernels import attention_gluon
    from gem_kernels import attention_triton as at

    tables = tables or {"forward": at.FORWARD_CONFIGS, "dq": at.DQ_CONFIGS}
    kernels: dict[str, Kernel] = {}
    picks = {}
    for which, tuned in (("forward", at.FORWARD), ("dq", at.DQ)):
        want = triton_pass(x, which)[0]  # tunes (if not yet), and names the key
        key, auto = tuned.last
        picks[which] = _config_name(auto)

        def pinned(config: tuple[int, ...], which: str = which, tuned: Any = tuned, key: tuple = key,
                   auto: tuple[int, ...] = auto) -> Any:  # fmt: skip
            tuned.chosen[key] = config  # read at launch, on the host; every other caller gets the tuner's pick
            try:
                return triton_pass(x, which, out[which])
            finally:
                tuned.chosen[key] = auto

        for config in tables[which]:
            refuse_if_wrong(f"attention_{which}@{_config_name(config)}", pinned(config)[0], want,
                             ATTENTION_TOLERANCE, "the tuned config's output")  # fmt: skip
            kernels[f"attention_{which}@{_config_name(config)}"] = Kernel(
                lambda p=pinned, c=config: p(c), forward_flops * MMAS[which] / 2)
    want_dkdv = triton_pass(x, "dkdv") if dkdv else ()
    for name in attention_gluon.DKDV_CONFIGS if dkdv else ():
        got = gluon_pass(x, "dkdv", name, out["dkdv"])
        for a, b in zip(got, want_dkdv, strict=True):
            refuse_if_wrong(f"attention_dkdv@{name}", a, b, ATTENTION_TOLERANCE, "the default config's output")
        kernels[f"attention_dkdv@{name}"] = Kernel(lambda n=name: gluon_pass(x, "dkdv", n, out["dkdv"]),
                                                   forward_flops * MMAS["dkdv"] / 2)  # fmt: skip
    print(f"tuner's picks on these inputs: {picks}; the dk/dv pass's default {attention_gluon.DEFAULT_DKDV_CONFIG}")
    return kernels


FP8_FORWARD_TOLERANCE = 0.1
"""The fp8 forward's largest relative error against the bf16 forward's output (``benchmarks/attention_fp8.py``'s
``--max-error``): e4m3 keeps 3 mantissa bits of ``q`` and ``k``."""


def attention_forward_fp8(x: dict[str, Any], forward_flops: float, out: torch.Tensor) -> dict[str, Kernel]:
    """The forward with ``q k^T`` in e4m3 (``fp8_forward``; ``q``, ``k`` cast per token and head before, as the
    fused gap's silu pass writes them, so not counted), checked against the bf16 forward first. Its FLOPs
    are the bf16 forward's: one of its two MMAs runs in e4m3."""
    from gem_kernels.attention_fp8 import quantize_qk
    from gem_kernels.attention_triton import query_major

    q8, k8, scales = quantize_qk(x["q"], x["k"])

    def call() -> tuple[torch.Tensor]:
        return (query_major(q8, k8, x["v"], None, x["offsets"], x["targets"], fp8_scales=scales, out=out,
                            **x["options"]),)  # fmt: skip

    refuse_if_wrong("attention_forward_fp8", call()[0], triton_pass(x, "forward")[0], FP8_FORWARD_TOLERANCE,
                     "the bf16 forward's output")  # fmt: skip
    return {"attention_forward_fp8": Kernel(call, forward_flops)}


def attention_backwards(x: dict[str, Any], forward_flops: float) -> dict[str, Kernel]:
    """The whole attention backward three ways: as shipped (the ``dq`` pass, then the ``dk``/``dv`` pass: 7
    MMAs a pair), with ``dq`` added by atomics in the key-major pass (5 MMAs a pair, the float32 buffer's
    zeroing and cast included), and with ``dq`` from the ``ds`` tiles the ``dk``/``dv`` pass stores
    (``dq_mode="stored"``, :mod:`gem_kernels.attention_stored`: 5 MMAs a pair and ~2 bytes a pair each way,
    the buffer's allocation included); and the stored form's two passes alone. Each form's gradients are
    checked against the shipped ones first."""
    from gem_kernels.attention_stored import dq_from_stored, prepare
    from gem_kernels.attention_triton_autograd import attention_backward
    from gem_kernels.attention_triton_bias import NO_BIAS
    from gem_kernels.attention_triton_bwd import key_major

    options = x["options"]
    plan = prepare(x["offsets"], x["q"].shape[1])

    def backward(mode: str) -> tuple[torch.Tensor, ...]:
        dq, dk, dv, _, _ = attention_backward(
            x["grad_out"], x["q"], x["k"], x["v"], x["offsets"], x["targets"], NO_BIAS,
            max_seq_len=options["max_seq_len"], alpha=options["alpha"], max_attn_len=options["max_attn_len"],
            dq_mode=mode, blocks=None, needs_position=False, needs_time=False, score_plan=plan,
        )  # fmt: skip
        return dq, dk, dv

    shipped = backward("separate")
    for mode in ("atomic", "stored"):
        for name, a, b in zip(("dq", "dk", "dv"), backward(mode), shipped, strict=True):
            refuse_if_wrong(f"attention_backward_{mode} ({name})", a, b, ATTENTION_TOLERANCE, "the shipped backward's")
    stored = plan.scores(x["q"].dtype)
    if stored is None:
        raise SystemExit("attention_backward_stored: the ds buffer passes attention_stored.BUDGET_BYTES")
    dk, dv, dq = torch.empty_like(x["k"]), torch.empty_like(x["v"]), torch.empty_like(x["q"])
    kernel_args = (x["q"], x["k"], x["v"], x["grad_out"], x["offsets"], x["targets"], None)
    key_options = {k: options[k] for k in ("max_seq_len", "alpha", "max_attn_len")}

    def dkdv_stored() -> tuple[torch.Tensor, torch.Tensor]:
        return key_major(*kernel_args, out=(dk, dv), stored=stored, **key_options)

    def dq_stored() -> torch.Tensor:
        return dq_from_stored(stored, x["k"], x["offsets"], x["targets"], max_seq_len=options["max_seq_len"],
                              alpha=options["alpha"], out=dq)  # fmt: skip

    stored.buffer.fill_(float("nan"))  # a tile the pass does not write poisons dq
    dkdv_stored()
    refuse_if_wrong("attention_dq_stored", dq_stored(), shipped[0], ATTENTION_TOLERANCE, "the shipped backward's dq")
    return {
        "attention_backward": Kernel(lambda: backward("separate"), forward_flops * 7 / 2),
        "attention_backward_atomic": Kernel(lambda: backward("atomic"), forward_flops * 5 / 2),
        "attention_backward_stored": Kernel(lambda: backward("stored"), forward_flops * 5 / 2),
        "attention_dkdv_stored": Kernel(dkdv_stored, forward_flops * 4 / 2),
        "attention_dq_stored": Kernel(dq_stored, forward_flops / 2),
    }
