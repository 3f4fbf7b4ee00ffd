"""The token mixers' attention (``gem_model.model.hstu.TokenMixer``) by each of torch's SDPA backends, on the
big config's shapes: B = 384 samples, 8 heads of 128, over the 5 feature tokens (the interaction layer) and
the 7 tokens of the cross layer.

The H100 profile of 2026-12-05 (``e2e_h100_s379.json``) shows the step's two mixer attentions backward on
cuDNN (torch's first choice there): a ``cutlass_75`` GEMM and cuDNN's ``compute_dot_do_o`` and
``convert_dq_to_16bits``, 1.44 ms a step for a few MFLOP. This times forward and backward of one
attention per backend as device work: a ``torch.cuda._sleep`` first holds the device while the host
queues ``--iters`` calls, so the host's launch time, which a training step hides, is not counted.

Each backend is checked first, on fresh random data, against float64 (output and the three input
gradients, error relative to the reference's largest entry). Interleaved rounds, median and IQR.

    python benchmarks/mixer_attention.py --rounds 15 --out mixer_attention.json
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from rounds import cell, rotated_queued_rounds, save_results, spread  # benchmarks/rounds.py, beside this script
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {
    "default": None,  # torch's own choice, the mixers' default (MIXER_SDPA_BACKENDS = None)
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: SDPBackend | None) -> torch.Tensor:
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v)
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v)


def forward_backward(inputs: list[torch.Tensor], grad: torch.Tensor, backend: SDPBackend | None) -> list[torch.Tensor]:
    for t in inputs:
        t.grad = None
    attention(*inputs, backend).backward(grad)
    return [t.grad for t in inputs]


def check(shape: tuple[int, ...], backend: SDPBackend | None, max_error: float) -> float | None:
    """The largest error of output and gradients relative to float64's largest entry; None where the backend
    has no kernel for this shape or device."""
    dev = torch.device("cuda")
    ref_in = [torch.randn(shape, device=dev, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    grad = torch.randn(shape, device=dev, dtype=torch.float64)
    inputs = [t.detach().bfloat16().requires_grad_() for t in ref_in]
    try:
        out = attention(*inputs, backend)
    except RuntimeError as e:  # "No available kernel"
        print(f"  {backend}: {str(e).splitlines()[0][:100]}")
        return None
    out.backward(grad.bfloat16())
    ref = F.scaled_dot_product_attention(*ref_in)
    ref.backward(grad)
    error = 0.0
    for got, want in zip([out, *(t.grad for t in inputs)], [ref, *(t.grad for t in ref_in)], strict=True):
        error = max(error, ((got.double() - want).abs().max() / want.abs().max()).item())
    if not error <= max_error:
        raise SystemExit(f"{backend} at {shape}: error {error:.2e} (max {max_error})")
    return error


def run_case(tokens: int, args: argparse.Namespace) -> list[dict]:
    shape = (args.batch, args.heads, tokens, args.head_dim)
    print(f"\n{tokens} tokens: q, k, v {list(shape)} bf16, forward and backward")
    errors = {name: check(shape, backend, args.max_error) for name, backend in BACKENDS.items()}
    names = [n for n, e in errors.items() if e is not None]
    inputs = [torch.randn(shape, device="cuda").bfloat16().requires_grad_() for _ in range(3)]
    grad = torch.randn(shape, device="cuda").bfloat16()
    fns = {n: (lambda n=n: forward_backward(inputs, grad, BACKENDS[n])) for n in names}
    times = rotated_queued_rounds(fns, args.rounds, args.iters, args.sleep_cycles)
    base = spread(times["default"])["median"] if "default" in times else None
    print("| backend | device ms a call, median (IQR) | vs default | error vs float64 |")
    print("|---|---|---|---|")
    results = []
    for name in names:
        s = spread(times[name])
        against = f"{base / s['median']:.2f}x" if base else ""
        print(f"| {name} | {cell(s)} | {against} | {errors[name]:.1e} |")
        results.append({"tokens": tokens, "backend": name, **s, "error": errors[name]})
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=384)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", default="5,7")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sleep-cycles", type=int, default=50_000_000)
    parser.add_argument("--max-error", type=float, default=2e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("mixer_attention.py times CUDA kernels: no GPU here", file=sys.stderr)
        return 1
    torch.manual_seed(args.seed)
    results = [r for t in args.tokens.split(",") if t for r in run_case(int(t), args)]
    save_results(args.out, results, batch=args.batch, heads=args.heads, head_dim=args.head_dim,
                 rounds=args.rounds, iters=args.iters, seed=args.seed)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
