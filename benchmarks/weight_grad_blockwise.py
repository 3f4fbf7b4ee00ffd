"""The weight gradient ``dW = g^T x`` in fp8 with 1 x 128 block scales (one per feature and block of 128
tokens, DeepSeek-V3's recipe, ``torch``'s ``ScalingType.BlockWise1x128`` through cuBLAS on Hopper)
against the bf16 GEMM that ``fp8_rowwise`` runs for it today, on the big config's shapes.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/weight_grad_blockwise.py --forward --out wgrad_blocks.json
    TRITON_INTERPRET=1 python benchmarks/weight_grad_blockwise.py --smoke   # a CPU check (no scaled GEMM there)

Why: in ``fp8_rowwise``'s step the bf16 weight-gradient GEMMs are the largest GEMM time left (~23 ms a
step on the big config). Scaled per feature over all tokens (``weight_gradient: fp8``) their operands
need each column's maximum before any byte is written, and the extra passes cost what the fp8 GEMM
saves. With a scale per 128 tokens, the kernel that produces ``g`` or ``x`` could write the transposed
e4m3 copy in its own pass. This script answers the first question: how fast the blockwise GEMM runs on
these shapes, and what a separate cast-and-transpose pass costs
(``gem_precision.fp8_blocks_triton``: the bound for a producer that writes the bytes itself is the
bytes alone).

Rows, timed with CUDA events in rotated order over ``--rounds`` rounds (median and quartiles):

- ``bf16``: ``torch.mm(g^T, x, out_dtype=float32)`` (``gem_precision.bf16_linear``'s weight gradient);
- ``fp8_gemm``: the blockwise fp8 GEMM on operands quantized beforehand;
- ``quantize``: both cast-and-transpose passes (``g`` and ``x``);
- ``fp8_all``: the two passes and the GEMM.

With ``--forward`` it also times the forward GEMM ``y = x W^T`` of the same shapes three ways: bf16,
row-scaled e4m3 (``fp8_rowwise`` today) and blockwise e4m3 (``x`` 1 x 128 per token, ``W`` in 128 x 128
blocks: DeepSeek-V3's forward), the operands quantized beforehand by the torch references (untimed).
A whole scheme in blocks would let every producer work on 128 x 128 tiles, whose row and column scales
it can both write; this row says whether its forward GEMM keeps the row-scaled one's speed.

Checks, on fresh random data: the fp8 GEMM against the float64 product of its own dequantized operands
(within 1e-3: on the H200 the float32-output form is 1.25e-4 off over 207,000 tokens, the
accumulation of Hopper's fp8 MMA, while a misread scale layout gives errors of order 1), and both forms against
the float64 ``g^T x`` (bf16 ~1e-3, e4m3 operands a few per cent). The scales' layout the GEMM accepts is
found by trying the candidates in order; the JSON says which one ran.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rounds import cell, rotated_rounds, save_results, spread  # beside this script

from gem_precision.formats import E4M3
from gem_precision.fp8_blocks_triton import quantize_fp8_blocks_t_triton
from gem_precision.fp8_reference import Fp8Operand, quantize_blocks_t_reference, quantize_fp8_reference

CASES = {"uvqk": (207_000, 1024, 4096), "out": (207_000, 1024, 1024)}
"""(tokens, in, out) of ``configs/h200-large.yaml``'s block linears; ~207,000 tokens a step."""
SMOKE_CASE = (300, 32, 48)
BLOCK = 128
GEMM_TOLERANCE = 1e-3
"""The fp8 GEMM against the float64 product of the same dequantized operands: Hopper's fp8 MMA accumulates
with fewer bits than float32 (1.25e-4 measured over 207,000 tokens on the H200, 2026-12-05); a misread
scale layout is off by order 1."""


def dequantized(op: Fp8Operand) -> torch.Tensor:
    """``[features, tokens_pad]`` float64: each byte times its feature's factor for its block of tokens."""
    return op.data.double() * op.scale_inv.double().repeat_interleave(BLOCK, dim=1)


GemmForm = Callable[[Fp8Operand, Fp8Operand], torch.Tensor]


def _operands(gq: Fp8Operand, xq: Fp8Operand, outer_b: bool) -> tuple[torch.Tensor, ...]:
    """``(a, b, scale_a, scale_b)`` for ``gq @ xq^T``: ``a [out, T]`` row-major, ``b [T, in]``
    column-major, ``scale_a [out, T / 128]`` with stride ``(1, out)``, ``scale_b [T / 128, in]`` row-major
    (or, ``outer_b``, with stride ``(1, T / 128)``)."""
    scale_b = xq.scale_inv.t()
    return gq.data, xq.data.t(), gq.scale_inv, scale_b.t().contiguous().t() if outer_b else scale_b


def gemm_forms() -> list[tuple[str, GemmForm]]:
    """The ways to ask torch for ``gq @ xq^T`` with 1 x 128 scales on both operands, most specific
    first: ``F.scaled_mm`` with the recipes named (torch >= 2.10) or ``torch._scaled_mm`` inferring them
    from the scales' shapes; ``x``'s scales row-major or outer-dim-major; a float32 or bf16 output."""
    forms: list[tuple[str, GemmForm]] = []
    scaled_mm = getattr(torch.nn.functional, "scaled_mm", None)
    recipe = None if scaled_mm is None else torch.nn.functional.ScalingType.BlockWise1x128
    for out_dtype in (torch.float32, torch.bfloat16):
        for outer_b in (False, True):
            name = f"{'outer' if outer_b else 'rows'}/{str(out_dtype).removeprefix('torch.')}"
            if scaled_mm is not None:

                def named(gq: Fp8Operand, xq: Fp8Operand, o: bool = outer_b, dt: torch.dtype = out_dtype) -> torch.Tensor:
                    a, b, sa, sb = _operands(gq, xq, o)
                    return scaled_mm(a, b, sa, recipe, sb, recipe, output_dtype=dt)

                forms.append((f"F.scaled_mm/{name}", named))

            def inferred(gq: Fp8Operand, xq: Fp8Operand, o: bool = outer_b, dt: torch.dtype = out_dtype) -> torch.Tensor:
                a, b, sa, sb = _operands(gq, xq, o)
                return torch._scaled_mm(a, b, sa, sb, out_dtype=dt)

            forms.append((f"torch._scaled_mm/{name}", inferred))
    return forms


def pick_gemm(gq: Fp8Operand, xq: Fp8Operand) -> tuple[str, GemmForm, float, dict[str, str]]:
    """The first form that runs and matches the float64 product of its dequantized operands."""
    want = dequantized(gq) @ dequantized(xq).t()
    refused: dict[str, str] = {}
    for name, fn in gemm_forms():
        try:
            got = fn(gq, xq)
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
            refused[name] = str(e).splitlines()[0][:200]
            continue
        err = float((got.double() - want).norm() / want.norm())
        if err <= GEMM_TOLERANCE:
            return name, fn, err, refused
        refused[name] = f"ran, but {err:.2e} from its operands' float64 product"
    raise SystemExit(f"no blockwise fp8 GEMM form ran correctly here: {refused}")


def square_blocks(w: torch.Tensor) -> Fp8Operand:
    """``w [out, in]`` in e4m3 with one power-of-two scale per 128 x 128 block (``in``, ``out`` multiples
    of 128): ``scale_inv [out / 128, in / 128]``."""
    o, i = w.shape
    blocks = w.float().reshape(o // BLOCK, BLOCK, i // BLOCK, BLOCK).permute(0, 2, 1, 3).reshape(-1, BLOCK * BLOCK)
    op = quantize_fp8_reference(blocks, granularity="row", fmt=E4M3).rows
    assert op is not None
    data = op.data.view(torch.uint8).reshape(o // BLOCK, i // BLOCK, BLOCK, BLOCK).permute(0, 2, 1, 3).reshape(o, i)
    return Fp8Operand(data.view(E4M3.dtype), op.scale_inv.reshape(o // BLOCK, i // BLOCK))


def forward_forms(xb: Fp8Operand, wb: Fp8Operand) -> list[tuple[str, Callable[[], torch.Tensor]]]:
    """``x W^T`` with ``x`` 1 x 128 (``xb``: ``[T, in]``, scales ``[T, in / 128]`` outer-dim-major) and
    ``W`` in 128 x 128 blocks (``wb``), bf16 out; ``W``'s scales as ``[in / 128, out / 128]`` in either
    memory order."""
    a, b, sa = xb.data, wb.data.t(), xb.scale_inv
    sb = wb.scale_inv.t()  # [in / 128, out / 128], the layout of W's blocks transposed
    forms: list[tuple[str, Callable[[], torch.Tensor]]] = []
    scaled_mm = getattr(torch.nn.functional, "scaled_mm", None)
    st = None if scaled_mm is None else torch.nn.functional.ScalingType
    for order, scale_b in (("as stored", sb), ("contiguous", sb.contiguous())):
        if scaled_mm is not None:
            forms.append((f"F.scaled_mm/{order}", lambda s_b=scale_b: scaled_mm(
                a, b, sa, st.BlockWise1x128, s_b, st.BlockWise128x128, output_dtype=torch.bfloat16)))  # fmt: skip
        forms.append((f"torch._scaled_mm/{order}", lambda s_b=scale_b: torch._scaled_mm(
            a, b, sa, s_b, out_dtype=torch.bfloat16)))  # fmt: skip
    return forms


def measure_forward(tokens: int, d_in: int, d_out: int, gen: torch.Generator, rounds: int) -> dict:
    """The forward GEMM in bf16, row-scaled e4m3 and blockwise e4m3, checked and timed."""
    x = torch.randn(tokens, d_in, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(d_out, d_in, device="cuda", generator=gen) * d_in**-0.5).bfloat16()
    xr = quantize_fp8_reference(x, granularity="row", fmt=E4M3).rows
    wr = quantize_fp8_reference(w, granularity="row", fmt=E4M3).rows
    assert xr is not None and wr is not None
    xb = quantize_blocks_t_reference(x.t(), E4M3)  # per token, 128 features at a time: [T, in], [T, in / 128]
    wb = square_blocks(w)
    want = (xb.data.double() * xb.scale_inv.double().repeat_interleave(BLOCK, dim=1)) @ (
        wb.data.double() * wb.scale_inv.double().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)).t()
    refused: dict[str, str] = {}
    chosen = None
    for name, fn in forward_forms(xb, wb):
        try:
            got = fn()
        except (RuntimeError, ValueError, NotImplementedError, TypeError) as e:
            refused[name] = str(e).splitlines()[0][:200]
            continue
        err = relative(got, want)
        if err <= 1e-2:  # bf16 output: its rounding, not the scales' reading
            chosen = (name, fn, err)
            break
        refused[name] = f"ran, but {err:.2e} from its operands' float64 product"
    del want
    rows: dict[str, Callable[[], torch.Tensor]] = {
        "fwd_bf16": lambda: torch.mm(x, w.t()),
        "fwd_rowwise": lambda: torch._scaled_mm(xr.data, wr.data.t(), xr.scale_inv, wr.scale_inv.t(), out_dtype=torch.bfloat16),
    }  # fmt: skip
    if chosen is not None:
        rows["fwd_blockwise"] = chosen[1]
    times = rotated_rounds(rows, rounds)
    stats = {n: spread(t) for n, t in times.items()}
    flop = 2.0 * tokens * d_in * d_out
    return {"forward_form": None if chosen is None else chosen[0], "forward_refused": refused,
            "forward_tflops": {n: flop / stats[n]["median"] / 1e9 for n in rows}, **stats}  # fmt: skip


def relative(a: torch.Tensor, exact: torch.Tensor) -> float:
    return float((a.double() - exact).norm() / exact.norm())


def smoke(gen: torch.Generator) -> int:
    """The quantizer (the interpreter on a CPU) and the operands' meaning, without the scaled GEMM."""
    tokens, d_in, d_out = SMOKE_CASE
    x = torch.randn(tokens, d_in, generator=gen).bfloat16()
    g = torch.randn(tokens, d_out, generator=gen).bfloat16()
    gq, xq = quantize_fp8_blocks_t_triton(g), quantize_fp8_blocks_t_triton(x)
    err = relative(dequantized(gq) @ dequantized(xq).t(), g.double().t() @ x.double())
    print(f"smoke: {tokens} tokens, {d_in} -> {d_out}: dequantized operands' g^T x {err:.2e} from float64")
    return 0 if err < 0.06 else 1


def measure(tokens: int, d_in: int, d_out: int, gen: torch.Generator, rounds: int) -> dict:
    """One case: the checks, then the four rows timed in rotated order."""
    x = torch.randn(tokens, d_in, device="cuda", generator=gen).bfloat16()
    g = torch.randn(tokens, d_out, device="cuda", generator=gen).bfloat16()
    gq, xq = quantize_fp8_blocks_t_triton(g), quantize_fp8_blocks_t_triton(x)
    form, gemm, gemm_err, refused = pick_gemm(gq, xq)
    exact = g.double().t() @ x.double()
    errors = {"bf16": relative(torch.mm(g.t(), x, out_dtype=torch.float32), exact), "fp8": relative(gemm(gq, xq), exact)}
    del exact

    def quantize() -> tuple[Fp8Operand, Fp8Operand]:
        return quantize_fp8_blocks_t_triton(g), quantize_fp8_blocks_t_triton(x)

    rows = {"bf16": lambda: torch.mm(g.t(), x, out_dtype=torch.float32), "fp8_gemm": lambda: gemm(gq, xq),
            "quantize": quantize, "fp8_all": lambda: gemm(*quantize())}  # fmt: skip
    times = rotated_rounds(rows, rounds)
    stats = {n: spread(t) for n, t in times.items()}
    flop = 2.0 * tokens * d_in * d_out
    return {"tokens": tokens, "in": d_in, "out": d_out, "gemm_form": form, "gemm_error_vs_operands": gemm_err,
            "refused_forms": refused, "errors": errors,
            "tflops": {n: flop / stats[n]["median"] / 1e9 for n in ("bf16", "fp8_gemm")},
            "bf16_over_fp8_all": statistics.median(b / f for b, f in zip(times["bf16"], times["fp8_all"], strict=True)),
            **stats}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: the quantizer, no GEMM")
    parser.add_argument("--forward", action="store_true", help="also the forward GEMM: bf16, rowwise, blockwise")
    args = parser.parse_args()
    gen = torch.Generator(device="cpu" if args.smoke else "cuda").manual_seed(torch.seed() % 2**31)
    if args.smoke:
        return smoke(gen)
    results = []
    names = ("bf16", "fp8_gemm", "quantize", "fp8_all")
    print(f"{'case':>5} {'tokens':>8} {'in':>5} {'out':>5} | "
          + " | ".join(f"{n + ' ms':>20}" for n in names) + f" | {'TFLOP/s bf16':>12} {'fp8':>6} | {'err bf16':>8} {'fp8':>8}")  # fmt: skip
    for case, shape in CASES.items():
        r = {"case": case, **measure(*shape, gen, args.rounds)}
        print(f"{case:>5} {r['tokens']:>8} {r['in']:>5} {r['out']:>5} | " + " | ".join(f"{cell(r[n]):>20}" for n in names)
              + f" | {r['tflops']['bf16']:12.0f} {r['tflops']['fp8_gemm']:6.0f} | {r['errors']['bf16']:8.1e} "
              f"{r['errors']['fp8']:8.1e}", flush=True)  # fmt: skip
        print(f"      GEMM form: {r['gemm_form']}; refused before it: {r['refused_forms'] or 'none'}; "
              f"bf16 / (passes + fp8 GEMM): {r['bf16_over_fp8_all']:.3f}x")  # fmt: skip
        if args.forward:
            f = measure_forward(*shape, gen, args.rounds)
            print("      forward: " + ", ".join(f"{n} {cell(f[n])} ms ({f['forward_tflops'][n]:.0f} TFLOP/s)"
                                              for n in f["forward_tflops"])
                  + f"; blockwise form {f['forward_form']}, refused {f['forward_refused'] or 'none'}")  # fmt: skip
            r["forward"] = f
        results.append(r)
    save_results(args.out, results, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
