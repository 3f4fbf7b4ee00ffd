"""How much accuracy ``dq`` would lose if the stored score gradients were kept in fp8 (CPU, float64).

``dq_mode="stored"`` keeps each ``ds`` tile of the attention backward in bf16 and reads it back for ``dq = ds k``
(:mod:`gem_kernels.attention_stored`). At the power cap the tiles' bytes cost energy; fp8 tiles would take half.
This prints the relative error of ``dq`` (Frobenius norm, and the largest element against the largest) against
the exact float64 product, for ``ds`` kept in bf16 and in e4m3 / e5m2 with one scale a stored tile (32 queries x
64 keys), one a query row of a tile, or one a key of a tile (the form built and removed on 2026-12-07: slower
and dearer than bf16 tiles, ``benchmarks/results/jagged_attention.md``); ``k`` in bf16 throughout, as the
``dq`` pass reads it. One causal sequence of ``n`` rows, random ``q, k, v`` and output gradient, HSTU's silu
scores.

    python benchmarks/stored_ds_precision.py --n 1024 --seed 0 --out stored_ds_precision.json
"""

from __future__ import annotations

import argparse
import json

import torch

TILE_Q, TILE_K = 32, 64  # gem_kernels.attention_stored's tile


def exact_ds(n: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ds = mask * dP * silu'(s)`` and ``k`` of one causal sequence, in float64."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, dim, generator=gen, dtype=torch.float64) for _ in range(3))
    grad_out = torch.randn(n, dim, generator=gen, dtype=torch.float64)
    s = (q @ k.T) / dim**0.5
    sig = torch.sigmoid(s)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool))
    return torch.where(mask, (grad_out @ v.T) * sig * (1 + s * (1 - sig)), 0.0), k


def quantized(ds: torch.Tensor, dtype: torch.dtype, per: str) -> torch.Tensor:
    """``ds`` through ``dtype`` and back, scaled to its range by tile, by query row of a tile, or by key (column)
    of a tile (``per``: ``tile``, ``row`` or ``key``; ``key``: one per key of a tile, the form that was built)."""
    out = torch.empty_like(ds)
    top = torch.finfo(dtype).max
    axis = {"tile": None, "row": 1, "key": 0}[per]
    for i in range(0, ds.shape[0], TILE_Q):
        for j in range(0, ds.shape[1], TILE_K):
            tile = ds[i : i + TILE_Q, j : j + TILE_K]
            amax = tile.abs().amax() if axis is None else tile.abs().amax(axis, keepdim=True)
            scale = top / torch.as_tensor(amax).clamp_min(1e-300)
            out[i : i + TILE_Q, j : j + TILE_K] = (tile * scale).to(dtype).double() / scale
    return out


def errors(n: int, dim: int, seed: int) -> list[dict[str, object]]:
    ds, k = exact_ds(n, dim, seed)
    want = ds @ k
    k16 = k.to(torch.bfloat16).double()
    kept = {"bf16": ds.to(torch.bfloat16).double()}
    for name, dtype in (("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)):
        kept[f"{name}, a scale a tile"] = quantized(ds, dtype, "tile")
        kept[f"{name}, a scale a tile row"] = quantized(ds, dtype, "row")
        kept[f"{name}, a scale a key of a tile"] = quantized(ds, dtype, "key")
    rows = []
    for name, tiles in kept.items():
        got = tiles @ k16
        rows.append({"ds kept in": name, "relative error": float((got - want).norm() / want.norm()),
                     "largest error / largest": float((got - want).abs().max() / want.abs().max())})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=1024, help="the sequence's length")
    parser.add_argument("--dim", type=int, default=128, help="the head dim")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    rows = errors(args.n, args.dim, args.seed)
    print(f"dq = ds k, n {args.n}, D {args.dim}, seed {args.seed}: error against float64")
    print(f"{'ds kept in':<30} {'relative':>10} {'largest':>10}")
    for row in rows:
        print(f"{row['ds kept in']:<30} {row['relative error']:>10.2e} {row['largest error / largest']:>10.2e}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "stored_ds_precision", "args": vars(args), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
