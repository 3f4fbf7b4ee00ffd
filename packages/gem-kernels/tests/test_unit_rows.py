"""``gem_kernels.unit_rows_triton`` against ``gem_model.api.unit_rows`` and an exact float64 gradient.

Fresh random rows per test (the ``gen`` fixture prints its seed), fresh memory NaN (``poison``): an
output element the kernels do not write fails. Rows of a zero vector and of a vector shorter than
``L2_EPS`` take the clamped branch (``x / eps``; the gradient ``g / eps``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gem_kernels.testing import relative_error
from gem_kernels.unit_rows_triton import unit_rows_triton, unit_rows_vjp_triton
from gem_model.api import L2_EPS, unit_rows, unit_rows_vjp

pytestmark = pytest.mark.usefixtures("poison")


def _rows(gen: torch.Generator, n: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(n, dim, generator=gen) * torch.rand(n, 1, generator=gen) * 4
    x[1] = 0.0  # norm 0: clamped
    x[2] = L2_EPS / (4 * dim**0.5)  # norm below eps: clamped
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_unit_rows_match_torch(gen: torch.Generator, dtype: torch.dtype) -> None:
    # 19 rows: not a multiple of the rows a program takes; 40 columns: not a power of two
    x = _rows(gen, 19, 40, dtype)
    u, norm = unit_rows_triton(x, torch.bfloat16)
    want_u, want_norm = unit_rows(x.float())
    assert u.dtype == torch.bfloat16 and u.shape == x.shape and norm.shape == (19,)
    torch.testing.assert_close(norm, want_norm[:, 0], rtol=1e-6, atol=0.0)
    # the same float32 value rounded to bf16: at most one bf16 step apart where the sums' order differs
    torch.testing.assert_close(u.float(), want_u.to(torch.bfloat16).float(), rtol=2**-7, atol=0.0)
    assert u[1].abs().max() == 0
    torch.testing.assert_close(u[2].float(), (x[2].float() / L2_EPS).to(torch.bfloat16).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_vjp_matches_the_exact_gradient(gen: torch.Generator, dtype: torch.dtype) -> None:
    x = _rows(gen, 21, 40, dtype)
    grad = torch.randn(21, 40, generator=gen)
    _, norm = unit_rows_triton(x, dtype)
    got = unit_rows_vjp_triton(grad, x, norm)
    assert got.dtype == dtype and got.shape == x.shape
    x64 = x.double().requires_grad_()
    (want,) = torch.autograd.grad(F.normalize(x64, dim=-1, eps=L2_EPS), x64, grad.double())
    tolerance = 1e-2 if dtype == torch.bfloat16 else 1e-5  # the result rounded to x's dtype
    assert relative_error(got, want) <= tolerance
    # and the torch form it replaces, in float32
    unit, norm32 = unit_rows(x.float())
    torch.testing.assert_close(got.float(), unit_rows_vjp(grad, unit, norm32).to(dtype).float(),
                               rtol=2**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-6)  # fmt: skip
    torch.testing.assert_close(got[1].float(), (grad[1] / L2_EPS).to(dtype).float())  # clamped: g / eps


def test_bad_shapes_name_the_argument() -> None:
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"unit_rows_triton: rows \[N, D\]"):
        unit_rows_triton(x[0], torch.float32)
    with pytest.raises(ValueError, match="unit_rows_vjp_triton: grad must be"):
        unit_rows_vjp_triton(torch.randn(4, 7), x, torch.ones(4))
    with pytest.raises(ValueError, match="norm float32"):
        unit_rows_vjp_triton(torch.randn(4, 8), x, torch.ones(4, dtype=torch.float64))


def test_no_rows() -> None:
    u, norm = unit_rows_triton(torch.empty(0, 8), torch.bfloat16)
    assert u.shape == (0, 8) and norm.shape == (0,)
    assert unit_rows_vjp_triton(torch.empty(0, 8), torch.empty(0, 8), norm).shape == (0, 8)
