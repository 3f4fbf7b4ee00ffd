"""Helpers for tests and benchmarks that check kernels against the references."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gem_kernels.reference import jagged_attention_reference
from gem_model.api import AttentionExtras, GradRows, PrequantizedRows, RowQuantization


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``|actual - expected| / |expected|`` (Frobenius norms, float64). NaN anywhere gives NaN."""
    expected = expected.double()
    diff = (actual.double() - expected).norm().item()
    scale = expected.norm().item()
    return diff / scale if scale > 0 else diff


def offsets_from_lengths(lengths: Sequence[int] | torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    return offsets.to(dtype)


def random_qkv(
    num_rows: int,
    heads: int,
    dim_qk: int,
    dim_v: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Uniform ``(-scale, scale)`` q, k ``[L, H, Dqk]`` and v ``[L, H, Dv]`` on CPU."""

    def draw(dim: int) -> torch.Tensor:
        return ((torch.rand(num_rows, heads, dim, generator=gen) * 2 - 1) * scale).to(dtype)

    return draw(dim_qk), draw(dim_qk), draw(dim_v)


def attention_errors(
    kernel: Callable[..., torch.Tensor],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    grad_out: torch.Tensor,
    *,
    max_seq_len: int,
    alpha: float,
    num_targets: torch.Tensor | None = None,
    max_attn_len: int = 0,
) -> dict[str, float]:
    """Relative errors of ``kernel``'s output and q/k/v gradients against the float64 reference.

    An element the kernel never wrote (NaN from poisoned memory) makes its error NaN, which fails
    any ``error < tolerance`` check.
    """
    extras = AttentionExtras(num_targets=num_targets, max_attn_len=max_attn_len)
    options = dict(max_seq_len=max_seq_len, alpha=alpha, extras=extras)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = kernel(*leaves, seq_offsets, **options)
    grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = jagged_attention_reference(*exact, seq_offsets, **options)
    expected_grads = torch.autograd.grad(expected, exact, grad_out.double(), allow_unused=True)
    errors = {"out": relative_error(out, expected)}
    for name, leaf, got, want in zip(("dq", "dk", "dv"), leaves, grads, expected_grads, strict=True):
        errors[name] = relative_error(
            got if got is not None else torch.zeros_like(leaf), want if want is not None else torch.zeros_like(leaf)
        )
    return errors


def block_output_and_grads(
    block: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, num_targets: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """An HSTU block's output on a fresh leaf copy of ``x`` and the gradients, for ``dy``, of ``x`` and of
    every parameter of the block (in ``named_parameters`` order): what the fused-block tests compare."""
    leaf = x.clone().requires_grad_()
    y = block(leaf, offsets, num_targets)
    return y, torch.autograd.grad(y, [leaf, *block.parameters()], dy)


def assert_offer_stands_for(offered: GradRows | None, grad: torch.Tensor, *, rows: bool, sums: bool) -> None:
    """A producer's offer for ``grad`` (``gem_model.api.GradRowsSlot.take``) holds what its slot asked for:
    e4m3 rows standing for ``grad`` (:func:`assert_rows_stand_for`) when ``rows``, else none; float32
    column sums within float32 rounding of float64's sums of ``grad`` when ``sums``, else none."""
    assert offered is not None, "nothing was offered for this gradient"
    if rows:
        assert offered.rows is not None
        assert_rows_stand_for(offered.rows, grad, column_amax=False)
    else:
        assert offered.rows is None
    if sums:
        want = grad.double().sum(0)
        assert offered.column_sum is not None and offered.column_sum.dtype == torch.float32
        torch.testing.assert_close(offered.column_sum.double(), want, rtol=1e-5, atol=1e-4 * want.abs().max().item())
    else:
        assert offered.column_sum is None


def assert_rows_stand_for(rows: PrequantizedRows, y: torch.Tensor, *, column_amax: bool = False) -> None:
    """``rows`` hold ``y`` (leading dims flattened) to e4m3's rounding with one power of two per row, each
    row's maximum near 448; with ``column_amax`` also ``y``'s column maxima (as int32 bits), else none."""
    y = y.reshape(-1, y.shape[-1]).float()
    assert rows.data.shape == y.shape and rows.scale_inv.shape == (y.shape[0],)
    scale_inv = rows.scale_inv
    mantissa, _ = torch.frexp(scale_inv)
    assert (mantissa == 0.5).all(), "scales are powers of two"
    back = rows.data.float() * scale_inv[:, None]
    assert (back - y).abs().le(y.abs() * 2.0**-4 + scale_inv[:, None] * 2.0**-9).all()
    amax = y.abs().amax(1)
    assert (amax / scale_inv <= RowQuantization.MAX).all() and (amax / scale_inv > RowQuantization.MAX / 4).all()
    if column_amax:
        assert torch.equal(rows.column_amax_bits, (y.view(torch.int32) & 0x7FFFFFFF).amax(0))
    else:
        assert rows.column_amax_bits is None
