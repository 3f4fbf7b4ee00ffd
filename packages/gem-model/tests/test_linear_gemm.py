"""gem_model.linear_gemm: asking a linear whether it runs a supplied forward GEMM, and handing it one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gem_model.api import GemmTakingLinear, call_linear, takes_gemm


class Takes(torch.nn.Module):
    def __init__(self, answer: object = True):
        super().__init__()
        self.linear = torch.nn.Linear(8, 4)
        self.answer = answer

    def takes_gemm(self, x: torch.Tensor) -> object:
        return self.answer

    def forward(self, x: torch.Tensor, *, gemm=None) -> torch.Tensor:
        run = gemm if gemm is not None else F.linear
        return run(x, self.linear.weight, self.linear.bias)


def test_a_linear_with_the_method_is_asked_and_handed_the_gemm() -> None:
    linear, x = Takes(), torch.randn(3, 8)
    assert isinstance(linear, GemmTakingLinear) and takes_gemm(linear, x)
    seen = []
    y = call_linear(linear, x, None, None, lambda a, w, b: seen.append(a.shape) or F.linear(a, w, b) * 2)
    assert seen == [(3, 8)]
    torch.testing.assert_close(y, 2 * linear.linear(x))
    torch.testing.assert_close(call_linear(linear, x, None), linear.linear(x))  # no gemm: the linear's own


def test_a_callable_without_the_method_takes_none_and_a_wrong_answer_is_named() -> None:
    x = torch.randn(3, 8)
    assert not takes_gemm(torch.nn.Linear(8, 4), x) and not takes_gemm(lambda t: t, x)
    assert not takes_gemm(Takes(False), x)
    with pytest.raises(TypeError, match="Takes.takes_gemm returned int; expected bool"):
        takes_gemm(Takes(1), x)
