"""Inputs that exercise every branch of the quantizers; used by the tests and by the GPU benchmark
(which checks the compiled kernels against the references on them). Also an HSTU-shaped block and a
counter of the saved-tensor hooks' work, for the activation policies' tests."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch


def _row(values: list[float], width: int = 64) -> list[float]:
    return (values * (width // len(values) + 1))[:width]


def mx_edge_cases() -> dict[str, torch.Tensor]:
    """Named float32 2-d tensors: zeros, subnormals, powers of two and just below, values above
    448 * 2**k, infinities, NaN, huge next to tiny, round-to-even ties, ragged shapes."""
    below = [math.nextafter(2.0**k, 0.0) for k in range(-8, 9)]
    cases: dict[str, list[list[float]]] = {
        "zeros": [[0.0] * 64, [-0.0] * 64],
        "subnormal_fp32": [_row([1e-40, -3e-42, 1.4e-45, 0.0]), _row([1e-39, 2e-39, -5e-39])],
        "e4m3_subnormal_range": [_row([448.0, 2.0**-7, 3 * 2.0**-10, 2.0**-10, -(2.0**-9) * 1.5, 0.0013])],
        "powers_of_two": [_row([2.0**k for k in range(-10, 10)]), _row([-(2.0**k) for k in range(20, 40)])],
        "just_below_powers_of_two": [_row(below), _row([-v for v in below])],
        "above_448": [_row([448.0 * 2.0**k for k in range(-3, 4)] + [449.0, 480.0, 511.0, 511.9])],
        "saturating_block": [_row([1.0, 1.9, 1.76, 1.75, 1.74]), _row([2.0**20 * 1.99, 3.0])],
        "inf": [_row([1.0, float("inf"), 2.0]), _row([float("-inf"), 5.0])],
        "nan": [_row([1.0, float("nan"), 3.0]), _row([7.0] * 31 + [float("nan")])],
        "huge_and_tiny": [_row([3e38, 1e-30, -2e37, 1e-3]), _row([1e20, 1e-20, 1.0])],
        "ties": [_row([256.0, 1.0625, 17.0, 19.0, 3 * 2.0**-10, 2.0**-10, 300.0, 304.0, 312.0])],
    }
    out = {name: torch.tensor(rows, dtype=torch.float32) for name, rows in cases.items()}
    gen = torch.Generator().manual_seed(1234)
    out["ragged_5x45"] = torch.randn(5, 45, generator=gen) * 10
    out["ragged_33x70"] = torch.randn(33, 70, generator=gen).mul(
        torch.exp2(torch.randint(-40, 40, (33, 70), generator=gen).float())
    )
    out["ragged_7x1"] = torch.randn(7, 1, generator=gen)
    return out


def wide_range_randn(rows: int, cols: int, *, generator: torch.Generator, spread: int = 30) -> torch.Tensor:
    """Normal values times 2**U(-spread, spread): blocks whose amaxes differ by many binades."""
    exps = torch.randint(-spread, spread + 1, (rows, cols), generator=generator).float()
    return torch.randn(rows, cols, generator=generator) * torch.exp2(exps)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of an fp8 / e8m0 tensor, for bit-exact comparisons."""
    return t.view(torch.uint8)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Frobenius relative error, in float64."""
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


class HstuLikeBlock(torch.nn.Module):
    """An HSTU-shaped block from plain torch ops, for activation-memory tests and benchmarks.

    ``u, v, q, k = split(silu(linear(layer_norm(x))))``; the attention is replaced by a pointwise
    stand-in ``silu(q * k) * v`` (same saved-tensor pattern per token, none of the L x L cost);
    then ``x + linear(layer_norm(a) * u)``.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.norm_in = torch.nn.LayerNorm(dim)
        self.uvqk = torch.nn.Linear(dim, 4 * dim)
        self.norm_attn = torch.nn.LayerNorm(dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, v, q, k = torch.nn.functional.silu(self.uvqk(self.norm_in(x))).split(self.dim, dim=-1)
        attn = torch.nn.functional.silu(q * k) * v
        return x + self.out(self.norm_attn(attn) * u)


@contextlib.contextmanager
def counting_packs() -> Iterator[list[torch.Size]]:
    """Inside, every tensor ``fp8_saved``'s saved-tensor hooks pack is listed (its shape): an empty
    list means the hooks never ran."""
    from gem_precision.saved_tensors import Fp8SavedTensors

    packed: list[torch.Size] = []
    pack = Fp8SavedTensors.pack

    def counting(self: Fp8SavedTensors, t: torch.Tensor) -> object:
        packed.append(t.shape)
        return pack(self, t)

    Fp8SavedTensors.pack = counting  # type: ignore[method-assign]
    try:
        yield packed
    finally:
        Fp8SavedTensors.pack = pack  # type: ignore[method-assign]


def producer_rows(x: torch.Tensor, *, column_amax: bool):
    """What a kernel that produces a linear's input ``x`` hands the linear (``gem_model.api.PrequantizedRows``):
    the reference's e4m3 rows of ``x`` (leading dims flattened) and, with ``column_amax``, its column maxima."""
    from gem_model.api import PrequantizedRows
    from gem_precision.formats import E4M3
    from gem_precision.fp8_reference import quantize_fp8_reference

    x2 = x.reshape(-1, x.shape[-1])
    op = quantize_fp8_reference(x2, granularity="row", fmt=E4M3).rows
    assert op is not None
    amax = (x2.float().view(torch.int32) & 0x7FFFFFFF).amax(0) if column_amax else None
    return PrequantizedRows(op.data, op.scale_inv.view(-1), amax)
