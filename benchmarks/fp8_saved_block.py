"""``fp8_saved`` on the fused HSTU blocks of the big config, on one GPU: peak memory and step time of a
stack of blocks (forward and backward) under each activation policy, interleaved.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/fp8_saved_block.py --out fp8_saved_block.json

The stack: ``--blocks`` (8) HSTU blocks of ``configs/h200-large.yaml`` (d = 1024, 8 heads of 128,
max_seq_len 4096) on gem-kernels' ``triton`` kernels (fused block), their linears converted by the
``--scheme`` (bf16: float32 master weights, bf16 GEMMs), activations in bf16. Inputs: B = 384 histories
with P(n) ~ (n + 1)^-0.95 over 1..4095 plus one target each (the config's lengths, ~200k rows), seed 7.

Variants (each a deep copy of the same stack, wrapped by the policy as the trainer does):

- ``none``: what the blocks save, as computed (the baseline);
- ``fp8_saved``: the policy's default, compressed in the fused kernels (``in_kernels``, no hooks);
- ``fp8_saved_hooks``: ``in_kernels: false``, the saved-tensor hooks on every block (the policy as it
  was before the fused kernels compressed);
- ``fp8_saved_attn_as_computed``: ``fp8_saved`` with the attention output kept as computed (as before
  2026-12-04 19:30 UTC); ``fp8_saved_rows_expanded``: with passes expanding the gate's and the attention
  output's e4m3 rows before the norm-gate backward, which reads them in its loop by default;
  ``fp8_saved_byte_stores``: with the norm-gate forward storing those rows as bytes, not 16-bit words
  (the two as before 2026-12-04 21:30 UTC; :data:`SWITCHES`).

First every variant's output and gradients (input, every parameter) are compared with ``none``'s, and
the e4m3 rows the fused gap keeps are compared byte for byte with gem-precision's reference row
quantizer on this device. Then ``--rounds`` rounds time one step of each variant in a rotated order
(CUDA events; the median is reported), each after ``reset_peak_memory_stats``: the peak over the step,
less what was allocated before it (parameters, inputs), and what the forward leaves allocated besides
its output (saved for backward). The issue's target: >= 30 % less peak than ``none`` at <= 5 % step
cost; the blocks are only part of a step of the whole model (tables, embeddings, loss), so the whole
model's figures come from ``benchmarks/e2e_ab.py`` with its switches ``fp8_saved`` and ``fp8_saved_hooks``
(``benchmarks/ab_switches_precision.py``), e.g.::

    torchrun --standalone --nproc-per-node 1 benchmarks/e2e_ab.py --config configs/h200-large.yaml \\
        --variants A=base,B=fp8_saved,C=fp8_saved_hooks --steps 60 --out ab-fp8-saved.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import statistics
import sys
from collections.abc import Iterator

import hstu_gap  # benchmarks/: the gap benchmark's inputs
import torch
from ab_switches_precision import PRECISION_VARIANTS  # benchmarks/: e2e_ab's switches

from gem_kernels.attention import TritonJaggedAttention
from gem_kernels.hstu_gap_saved import silu_quantize_rows
from gem_kernels.norm_gate import TritonNormGate
from gem_kernels.testing import relative_error
from gem_model.model.hstu import HSTUBlock
from gem_precision.activation import Fp8SavedPolicy, NoActivationPolicy
from gem_precision.formats import E4M3
from gem_precision.fp8_reference import quantize_fp8_reference
from gem_precision.schemes import Bf16Scheme, Fp8RowwiseScheme

D, H, HD, N = 1024, 8, 128, 4096
GIB = 2**30
VARIANTS = {
    "none": lambda: NoActivationPolicy(),
    "fp8_saved": lambda: Fp8SavedPolicy(),
    "fp8_saved_hooks": lambda: Fp8SavedPolicy(Fp8SavedPolicy.Config(in_kernels=False)),
    "fp8_saved_attn_as_computed": lambda: Fp8SavedPolicy(),
    "fp8_saved_rows_expanded": lambda: Fp8SavedPolicy(),
    "fp8_saved_byte_stores": lambda: Fp8SavedPolicy(),
}
Y_TOLERANCE = {"fp8_saved_byte_stores": 1e-2}
"""The blocks' output under a policy against ``none``'s (relative, Frobenius): every variant computes
its forward from the exact activations, so its output must equal ``none``'s bit for bit (measured on the
H200, 2026-12-04 21:25 UTC), except where named here. With its rows stored as bytes, the norm-gate pass
that also writes the attention output's e4m3 rows sums each row's mean and variance in another order on
a GPU (the byte stores change the tile's layout), so the output may differ in the last bit of some
values, which the next blocks carry on."""
SWITCHES = {
    # e2e_ab's switches (ab_switches_precision) that set a module flag, applied while a variant's steps run
    "fp8_saved_attn_as_computed": "fp8_saved_attn_as_computed",
    "fp8_saved_rows_expanded": "fp8_saved_rows_expanded",
    "fp8_saved_byte_stores": "fp8_byte_stores",
}
"""A variant's e2e switch, set while its steps run (forward and backward) and undone after."""


@contextlib.contextmanager
def flags_of(name: str) -> Iterator[None]:
    undo = PRECISION_VARIANTS[SWITCHES[name]](None) if name in SWITCHES else (lambda: None)
    try:
        yield
    finally:
        undo()


SCHEMES = {"bf16": Bf16Scheme, "fp8_rowwise": Fp8RowwiseScheme}


class Stack(torch.nn.Module):
    def __init__(self, blocks: int, scheme: str):
        super().__init__()
        attention, norm_gate = TritonJaggedAttention(), TritonNormGate()
        self.blocks = torch.nn.ModuleList(
            HSTUBlock(dim=D, num_heads=H, attention_dim=HD, value_dim=HD, max_seq_len=N, max_attn_len=0,
                      alpha=1 / HD**0.5, dropout=0.0, attention=attention, norm_gate=norm_gate)
            for _ in range(blocks)
        )  # fmt: skip
        converter = SCHEMES[scheme]()
        for i, block in enumerate(self.blocks):
            block.uvqk = converter.convert_linear(block.uvqk, f"blocks.{i}.uvqk")
            block.out = converter.convert_linear(block.out, f"blocks.{i}.out")

    def forward(self, x: torch.Tensor, offsets: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, offsets, targets)
        return x


def inputs(device: torch.device) -> dict:
    """The gap benchmark's histories (``hstu_gap.inputs``), the blocks' input and output gradient."""
    lengths = hstu_gap.inputs(device)
    rows = lengths["rows"]
    dgen = torch.Generator(device).manual_seed(7)
    return dict(
        x=torch.randn(rows, D, generator=dgen, device=device).to(torch.bfloat16),
        dy=torch.randn(rows, D, generator=dgen, device=device).to(torch.bfloat16),
        offsets=lengths["offsets"], targets=lengths["targets"], rows=rows,
    )


def step(model: Stack, x: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    xi = x["x"].detach().requires_grad_()
    y = model(xi, x["offsets"], x["targets"])
    y.backward(x["dy"])
    return y.detach(), [xi.grad, *(p.grad for p in model.parameters())]


def measured_step(model: Stack, x: dict, device: torch.device) -> dict:
    torch.cuda.synchronize(device)
    model.zero_grad(set_to_none=True)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    xi = x["x"].detach().requires_grad_()
    start.record()
    y = model(xi, x["offsets"], x["targets"])
    after_forward = torch.cuda.memory_allocated(device)
    y.backward(x["dy"])
    end.record()
    torch.cuda.synchronize(device)
    saved = after_forward - base - y.untyped_storage().nbytes()
    del y, xi
    return {"ms": start.elapsed_time(end), "peak": torch.cuda.max_memory_allocated(device) - base, "saved": saved}


def check_bits(device: torch.device, rows: int) -> dict:
    """The fused gap's e4m3 rows against gem-precision's reference row quantizer, on this device."""
    gen = torch.Generator(device).manual_seed(11)
    pre = (torch.randn(rows, 4 * H * HD, generator=gen, device=device) * 3).to(torch.bfloat16)
    pre[::97] *= 2.0**-20  # rows far below the others: their own scales, subnormals of e4m3 among them
    data, scale_inv = silu_quantize_rows(pre, torch.empty(rows, 3 * H * HD, dtype=pre.dtype, device=device), H * HD)
    want = quantize_fp8_reference(pre, granularity="row", fmt=E4M3).rows
    bytes_differ = int((data.view(torch.uint8) != want.data.view(torch.uint8)).sum())
    scales_differ = int((scale_inv.view(torch.int32) != want.scale_inv.reshape(-1).view(torch.int32)).sum())
    return {"rows": rows, "bytes_differ": bytes_differ, "scales_differ": scales_differ}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--scheme", choices=sorted(SCHEMES), default="bf16")
    p.add_argument("--rounds", type=int, default=12, help="timed steps per variant, interleaved")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--out")
    args = p.parse_args()
    names = args.variants.split(",")
    if names[0] != "none" or any(n not in VARIANTS for n in names):
        raise SystemExit(f"--variants: start with none, then any of {', '.join(VARIANTS)}; got {args.variants}")
    device = torch.device("cuda")
    torch.manual_seed(7)
    base = Stack(args.blocks, args.scheme).to(device)
    x = inputs(device)
    print(f"{args.blocks} blocks, {x['rows']:,} rows, scheme {args.scheme}", flush=True)
    bits = check_bits(device, 4096)
    print(f"e4m3 rows against the reference quantizer: {bits}", flush=True)
    models = {}
    for name in names:
        model = copy.deepcopy(base)
        policy = VARIANTS[name]()
        for i, block in enumerate(model.blocks):
            policy.wrap_block(block, f"blocks.{i}")
        models[name] = model
    del base
    want_y, want_g = step(models["none"], x)  # also compiles and tunes every kernel
    errors = {}
    for name in names[1:]:
        with flags_of(name):
            y, g = step(models[name], x)
        errors[name] = {"y_equal": bool(torch.equal(y, want_y)), "y": relative_error(y, want_y),
                        "d_x": relative_error(g[0], want_g[0]),
                        "d_params_max": max(relative_error(a, b) for a, b in zip(g[1:], want_g[1:]))}  # fmt: skip
        print(f"{name} against none: {errors[name]}", flush=True)
    del want_y, want_g
    samples: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            with flags_of(name):
                samples[name].append(measured_step(models[name], x, device))
    summary = {}
    for name in names:
        s = samples[name]
        q1, _, q3 = statistics.quantiles([v["ms"] for v in s], n=4, method="inclusive")
        summary[name] = {"ms": statistics.median(v["ms"] for v in s), "ms_q1": q1, "ms_q3": q3,
                         "peak_gib": max(v["peak"] for v in s) / GIB,
                         "saved_gib": max(v["saved"] for v in s) / GIB}  # fmt: skip
    ref = summary["none"]
    print(f"\n{'variant':<27} {'saved GiB':>10} {'peak GiB':>9} {'peak vs none':>13} {'step ms (q1-q3)':>22} {'step vs none':>13}")
    for name in names:
        v = summary[name]
        v["peak_change"], v["step_change"] = v["peak_gib"] / ref["peak_gib"] - 1, v["ms"] / ref["ms"] - 1
        spread = f"{v['ms']:.2f} ({v['ms_q1']:.2f}-{v['ms_q3']:.2f})"
        print(f"{name:<27} {v['saved_gib']:>10.2f} {v['peak_gib']:>9.2f} {v['peak_change']:>+12.1%} {spread:>22} "
              f"{v['step_change']:>+12.1%}")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                       "device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "rows": x["rows"],
                       "blocks": args.blocks, "scheme": args.scheme, "bits": bits, "errors": errors,
                       "summary": summary, "samples": samples}, f, indent=1)  # fmt: skip
    ok = bits["bytes_differ"] == 0 and bits["scales_differ"] == 0 and all(
        e["y"] <= Y_TOLERANCE.get(name, 0.0) for name, e in errors.items())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
