"""``bias_grad_elsewhere``: a linear lends its bias for another kernel to sum its gradient; the forward is
unchanged, the linear's own backward leaves the bias alone, and the bias is given back afterwards."""

from __future__ import annotations

import torch

from gem_model.api import bias_grad_elsewhere, lent_from


def test_the_forward_is_the_same_and_only_the_caller_routes_the_bias_gradient():
    torch.manual_seed(0)
    linear = torch.nn.Linear(5, 3)
    x = torch.randn(4, 5)
    with bias_grad_elsewhere(linear) as bias:
        assert bias is not None and bias is not linear.bias and not linear.bias.requires_grad
        assert linear.bias.data_ptr() == bias.data_ptr()  # an alias, not a copy
        y = linear(x)
    assert linear.bias is bias and bias.requires_grad  # given back
    torch.testing.assert_close(y, x @ linear.weight.T + bias, rtol=0, atol=0)
    y.sum().backward()
    assert bias.grad is None and linear.weight.grad is not None  # the linear did not sum its output's gradient


def test_nothing_is_lent_without_a_bias_that_takes_a_gradient():
    for linear in (torch.nn.Linear(3, 2, bias=False), torch.nn.Linear(3, 2).requires_grad_(False), lambda x: x):
        with bias_grad_elsewhere(linear) as bias:
            assert bias is None
    linear = torch.nn.Linear(3, 2)
    with torch.no_grad(), bias_grad_elsewhere(linear) as bias:
        assert bias is None and linear.bias.requires_grad


def test_the_bias_is_given_back_when_the_call_fails():
    linear = torch.nn.Linear(3, 2)
    own = linear.bias
    try:
        with bias_grad_elsewhere(linear):
            raise RuntimeError("the linear failed")
    except RuntimeError:
        pass
    assert linear.bias is own


def test_lent_from_names_the_bias_a_lent_alias_stands_for():
    linear = torch.nn.Linear(3, 2)
    bias = linear.bias
    with bias_grad_elsewhere(linear):
        alias = linear.bias
        assert alias is not bias and lent_from(alias) is bias
    assert lent_from(bias) is bias and lent_from(linear.weight) is linear.weight
    detached = bias.detach()
    assert lent_from(detached) is detached  # only the alias the context lends
