"""The weight gradient ``dW = g^T x`` in fp8 with 1 x 128 block scales (one per feature and block of 128
tokens, DeepSeek-V3's recipe, ``torch``'s ``ScalingType.BlockWise1x128`` through cuBLAS on Hopper)
against the bf16 GEMM that ``fp8_rowwise`` runs for it today, on the big config's shapes.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python benchmarks/weight_grad_blockwise.py --out wgrad_blocks.json
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

Checks, on fresh random data: the fp8 GEMM against the float64 product of its own dequantized operands
(float32 accumulation: ~1e-6; a misread scale layout gives errors of order 1), and both forms against
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

from gem_precision.fp8_blocks_triton import quantize_fp8_blocks_t_triton
from gem_precision.fp8_reference import Fp8Operand

CASES = {"uvqk": (207_000, 1024, 4096), "out": (207_000, 1024, 1024)}
"""(tokens, in, out) of ``configs/h200-large.yaml``'s block linears; ~207,000 tokens a step."""
SMOKE_CASE = (300, 32, 48)
BLOCK = 128
GEMM_TOLERANCE = 1e-4
"""The fp8 GEMM against the float64 product of the same dequantized operands (float32 accumulation)."""


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
        results.append(r)
    save_results(args.out, results, rounds=args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
