"""``gem_precision.column_sums_triton.column_sums`` (Triton's interpreter on the CPU) against float64
sums, and the ``bf16`` linear's bias gradient through it (``bf16_linear.BIAS_GRAD_KERNEL``). Fresh random
data per test (``gen`` prints its seed)."""

from __future__ import annotations

import pytest
import torch

from gem_precision import bf16_linear, column_sums_triton
from gem_precision.bf16_linear import Bf16LinearFunction
from gem_precision.column_sums_triton import column_sums


@pytest.mark.parametrize("shape", [(1, 3), (97, 40), (300, 300)], ids=["one_row", "odd", "two_column_blocks"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_matches_float64_sums(gen: torch.Generator, monkeypatch, shape: tuple[int, int], dtype: torch.dtype) -> None:
    monkeypatch.setattr(column_sums_triton, "BLOCK_M", 16)  # bands of 16 rows: several per program and program
    monkeypatch.setattr(column_sums_triton, "PROGRAMS_PER_SM", 3)  # several bands at 300 rows (2 "SMs" on the CPU)
    g = (torch.randn(shape, generator=gen) * 3).to(dtype)
    got = column_sums(g)
    want = g.double().sum(0)
    assert got.dtype == torch.float32 and got.shape == (shape[1],)
    # float32 sums of at most 300 terms of size ~3: within a few float32 roundings of the exact sum
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(column_sums(g), got)  # a fixed order of additions: the same bits again


def test_strided_rows_and_empty(gen: torch.Generator) -> None:
    g = torch.randn(50, 64, generator=gen)[:, ::2]  # columns not contiguous: copied first
    torch.testing.assert_close(column_sums(g).double(), g.double().sum(0), rtol=1e-5, atol=1e-5)
    assert torch.equal(column_sums(torch.empty(0, 5)), torch.zeros(5))
    with pytest.raises(ValueError, match=r"column_sums: a 2-D \[M, N\] tensor"):
        column_sums(torch.ones(3))


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "kernel"])
def test_bf16_linear_bias_gradient(gen: torch.Generator, monkeypatch, kernel: bool) -> None:
    """The bias gradient through ``Bf16LinearFunction`` (a supplied GEMM takes that path on the CPU) is the
    float32 column sum of the output gradient, with the kernel or torch's reduction."""
    monkeypatch.setattr(bf16_linear, "BIAS_GRAD_KERNEL", kernel)
    monkeypatch.setattr(bf16_linear, "BIAS_GRAD_KERNEL_ROWS", 64)
    calls = []
    real = column_sums_triton.column_sums
    monkeypatch.setattr(column_sums_triton, "column_sums", lambda g: calls.append(g.shape) or real(g))
    x = torch.randn(130, 24, generator=gen).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(40, 24, generator=gen).requires_grad_()
    bias = torch.randn(40, generator=gen).requires_grad_()
    gy = torch.randn(130, 40, generator=gen).to(torch.bfloat16)

    def gemm(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(a, w, b)

    Bf16LinearFunction.apply(x, weight, bias, None, None, gemm).backward(gy)
    assert bias.grad is not None and bias.grad.dtype == torch.float32
    torch.testing.assert_close(bias.grad.double(), gy.double().sum(0), rtol=1e-5, atol=1e-4)
    assert calls == ([(130, 40)] if kernel else [])


@pytest.mark.parametrize("offer", ["sums", "nothing", "another_gradient"])
def test_bf16_linear_takes_its_bias_gradient_from_the_producers_offer(gen: torch.Generator, offer: str) -> None:
    """With a slot for column sums alone (``BIAS_SUMS_FROM_PRODUCER``), the backward takes the bias gradient
    that the gradient's producer offered, and sums the gradient itself when nothing was offered for the
    gradient it got (here the producer is a hook on the output, as a kernel would be the op after it)."""
    x = torch.randn(30, 24, generator=gen).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(40, 24, generator=gen).requires_grad_()
    bias = torch.randn(40, generator=gen).requires_grad_()
    gy = torch.randn(30, 40, generator=gen).to(torch.bfloat16)
    slot = bf16_linear.GradRowsSlot(column_sum=True, rows=False)
    offered = torch.randn(40, generator=gen)  # not gy's sums: the test sees which one the bias got

    def producer(grad: torch.Tensor) -> torch.Tensor | None:
        if offer == "sums":
            slot.offer(grad, None, offered)
        elif offer == "another_gradient":
            slot.offer(grad.clone(), None, offered)
        return None

    def gemm(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return torch.nn.functional.linear(a, w, b)

    y = Bf16LinearFunction.apply(x, weight, bias, None, None, gemm, slot)
    y.register_hook(producer)
    y.backward(gy)
    if offer == "sums":
        assert torch.equal(bias.grad, offered)
    else:
        torch.testing.assert_close(bias.grad.double(), gy.double().sum(0), rtol=1e-5, atol=1e-4)
    assert slot.take(gy) is None  # taken, or emptied by the take that found another gradient


def test_bf16_linear_asks_for_its_bias_sums_only_where_they_can_be_taken(monkeypatch) -> None:
    linear = bf16_linear.Bf16Linear(torch.nn.Linear(8, 4), fqn="blocks.0.out")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setattr(bf16_linear, "BIAS_SUMS_FROM_PRODUCER", False)
    assert linear.grad_rows_slot(cuda) is None
    monkeypatch.setattr(bf16_linear, "BIAS_SUMS_FROM_PRODUCER", True)
    slot = linear.grad_rows_slot(cuda)
    assert slot is not None and slot.column_sum and not slot.rows
    assert linear.grad_rows_slot(cpu) is None  # the CPU's path is autograd's, which takes no offers
    linear.bias.requires_grad_(False)
    assert linear.grad_rows_slot(cuda) is None
    assert bf16_linear.Bf16Linear(torch.nn.Linear(8, 4, bias=False), fqn="head").grad_rows_slot(cuda) is None
    with pytest.raises(TypeError, match="blocks.0.out: grad_rows must be a GradRowsSlot"):
        linear(torch.randn(2, 8), grad_rows="slot")
