"""The ``bf16`` scheme's shared cast cache (:mod:`gem_precision.cast_cache`), on fresh random data.

The cached path runs only on a GPU (``bf16_linear._direct``); here ``_direct`` is forced on the CPU,
where :class:`Bf16LinearFunction` computes the same math (its ``dW`` falls back to the bf16 product
cast), so the cached and uncached forms must agree bit for bit, before and after the optimizer moves
the weights."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gem_model.api import bias_grad_elsewhere
from gem_precision import bf16_linear
from gem_precision.cast_cache import CastCache
from gem_precision.schemes import Bf16Scheme

BF16 = torch.bfloat16


def test_copies_follow_in_place_updates_and_are_remade_together(gen: torch.Generator) -> None:
    a = nn.Parameter(torch.randn(16, 8, generator=gen))
    b = nn.Parameter(torch.randn(8, generator=gen))
    cache = CastCache()
    cache.add(a)
    cache.add(b)
    cache.add(a)  # idempotent
    cache.add(None)
    assert torch.equal(cache.get(a), a.detach().to(BF16)) and cache.get(a).dtype == BF16
    assert torch.equal(cache.get(b), b.detach().to(BF16))
    assert cache.refreshes == 1  # both made by the first get
    first = cache.get(a)
    assert cache.get(a) is first and cache.refreshes == 1  # unchanged: read, not remade
    with torch.no_grad():  # what an optimizer step does
        a.add_(torch.randn(16, 8, generator=gen))
        b.mul_(3.0)
    assert torch.equal(cache.get(b), b.detach().to(BF16))
    assert cache.refreshes == 2  # b's get remade a's copy too
    assert torch.equal(cache.get(a), a.detach().to(BF16)) and cache.refreshes == 2
    a.data = torch.randn(16, 8, generator=gen)  # new storage (as module.to does)
    assert torch.equal(cache.get(a), a.detach().to(BF16)) and cache.refreshes == 3
    with pytest.raises(KeyError, match=r"shape \(3,\) was never added"):
        cache.get(torch.zeros(3))


def test_an_optimizer_step_stales_every_copy_even_without_a_version_bump(gen: torch.Generator) -> None:
    p = nn.Parameter(torch.randn(8, generator=gen))
    cache = CastCache()
    cache.add(p)
    cache.get(p)
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)  # fused: the version counter stays where it was
    p.grad = torch.randn(8, generator=gen)
    version = p._version
    opt.step()
    assert p._version == version  # what makes the hook necessary (torch 2.13)
    assert torch.equal(cache.get(p), p.detach().to(BF16)) and cache.refreshes == 2


def _linears(gen: torch.Generator) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    return nn.Linear(32, 24), nn.Linear(24, 16, bias=False)


def _train(model: nn.Sequential, xs: list[torch.Tensor], fused: bool) -> list[torch.Tensor]:
    """An optimizer step per input; the outputs and every gradient of each. The fused AdamW updates the
    parameters without bumping their version counters: the cache sees its steps by its global hook."""
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused)
    seen = []
    for x in xs:
        opt.zero_grad(set_to_none=True)
        y = model(x)
        y.float().square().sum().backward()
        seen += [y.detach()] + [p.grad.clone() for p in model.parameters()]
        opt.step()
    return seen


@pytest.mark.parametrize("fused", [False, True], ids=["adamw", "fused_adamw"])
def test_the_cached_linear_trains_bit_for_bit_as_the_uncached_one(gen: torch.Generator, fused: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bf16_linear, "_direct", lambda x, weight: True)  # the GPU path, on the CPU
    first, second = _linears(gen)
    xs = [torch.randn(40, 32, generator=gen).to(BF16) for _ in range(3)]
    results = {}
    for cast_once in (True, False):
        monkeypatch.setattr(bf16_linear, "CAST_ONCE", cast_once)
        scheme = Bf16Scheme()
        model = nn.Sequential(scheme.convert_linear(_copy(first), "a"), scheme.convert_linear(_copy(second), "b"))
        results[cast_once] = _train(model, xs, fused)
        cache = model[0].cast_cache
        assert cache is model[1].cast_cache  # one cache for the scheme's linears
        assert cache.refreshes == (3 if cast_once else 0)  # once a step, both linears' copies at once
    assert len(results[True]) == len(results[False])
    for cached, plain in zip(results[True], results[False]):
        assert torch.equal(cached, plain)


def _copy(linear: nn.Linear) -> nn.Linear:
    out = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    out.load_state_dict(linear.state_dict())
    return out


class _BiasGradHere(torch.autograd.Function):
    """The caller's side of ``bias_grad_elsewhere``: identity forward; the backward sums the output's
    gradient into the lent bias (what the fused HSTU gap does for its ``uvqk`` projection)."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.bias_dtype = bias.dtype
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        return grad, grad.reshape(-1, grad.shape[-1]).sum(0, dtype=torch.float32).to(ctx.bias_dtype)


def _block(linear: nn.Module, x: torch.Tensor, lend: bool, gemm=None) -> torch.Tensor:
    """``linear(x)``, its bias lent as ``gem_kernels.hstu_block`` lends uvqk's (``bias_grad_in_gap``)."""
    if not lend:
        return linear(x, gemm=gemm)
    with bias_grad_elsewhere(linear) as bias:
        assert bias is not None and linear.bias is not bias  # the linear sees a detached alias
        y = linear(x, gemm=gemm)
    return _BiasGradHere.apply(y, bias)


def _f_linear_gemm(x: torch.Tensor, w16: torch.Tensor, b16: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w16, b16)


@pytest.mark.parametrize("gemm", [None, _f_linear_gemm], ids=["f_linear", "supplied_gemm"])
def test_a_lent_bias_is_read_from_the_cache_bit_for_bit(gen: torch.Generator, gemm,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200's crash (``KeyError: ... shape (4096,) was never added``): under ``bias_grad_elsewhere``
    the linear's ``bias`` is a detached alias of the registered Parameter, a different object."""
    monkeypatch.setattr(bf16_linear, "_direct", lambda x, weight: True)  # the GPU path, on the CPU
    first, _ = _linears(gen)
    x = torch.randn(2, 20, 32, generator=gen).to(BF16)
    gy = torch.randn(2, 20, 24, generator=gen).to(BF16)
    results = {}
    for cast_once in (True, False):
        monkeypatch.setattr(bf16_linear, "CAST_ONCE", cast_once)
        linear = Bf16Scheme().convert_linear(_copy(first), "blocks.0.uvqk")
        xi = x.clone().requires_grad_()
        y = _block(linear, xi, lend=True, gemm=gemm)
        y.backward(gy)
        assert linear.bias is linear._parameters["bias"] and linear.bias.grad is not None  # given back
        results[cast_once] = [y.detach(), xi.grad, linear.weight.grad, linear.bias.grad]
        assert linear.cast_cache.refreshes == (1 if cast_once else 0)
    for name, cached, plain in zip(("y", "dx", "dW", "db"), results[True], results[False], strict=True):
        assert cached.dtype == plain.dtype and torch.equal(cached, plain), name


@pytest.mark.parametrize("lend", [False, True], ids=["own_bias", "lent_bias"])
def test_cast_once_switched_on_between_steps_of_a_live_run(gen: torch.Generator, lend: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``benchmarks/ab_switches_precision.py`` flips ``CAST_ONCE`` between steps of a running trainer
    (fused AdamW), then off again: every step's output and gradients are those of a run that never did."""
    monkeypatch.setattr(bf16_linear, "_direct", lambda x, weight: True)
    first, second = _linears(gen)
    xs = [torch.randn(40, 32, generator=gen).to(BF16) for _ in range(5)]
    switch = (False, False, True, True, False)  # on for steps 2 and 3
    results = {}
    for flips in (True, False):
        monkeypatch.setattr(bf16_linear, "CAST_ONCE", False)
        scheme = Bf16Scheme()
        a, b = scheme.convert_linear(_copy(first), "a"), scheme.convert_linear(_copy(second), "b")
        opt = torch.optim.AdamW([*a.parameters(), *b.parameters()], lr=0.05, fused=True)
        seen = []
        for x, on in zip(xs, switch, strict=True):
            monkeypatch.setattr(bf16_linear, "CAST_ONCE", on and flips)
            opt.zero_grad(set_to_none=True)
            y = b(_block(a, x, lend))
            y.float().square().sum().backward()
            seen += [y.detach()] + [p.grad.clone() for p in (*a.parameters(), *b.parameters())]
            opt.step()
        results[flips] = seen
        assert a.cast_cache.refreshes == (2 if flips else 0)  # once in each step it was on
    for cached, plain in zip(results[True], results[False], strict=True):
        assert torch.equal(cached, plain)


def test_the_alias_bias_grad_elsewhere_lends_reads_its_parameters_copy(gen: torch.Generator) -> None:
    p = nn.Parameter(torch.randn(6, 4, generator=gen))
    other = nn.Parameter(torch.randn(6, 4, generator=gen))
    cache = CastCache()
    cache.add(p)
    cache.add(other)
    linear = nn.Linear(4, 6)
    linear.bias = p  # any module with a bias Parameter: bias_grad_elsewhere lends it
    with bias_grad_elsewhere(linear) as lent:
        alias = linear.bias
        assert lent is p and alias is not p
        assert cache.get(alias) is cache.get(p) and cache.refreshes == 1
        with torch.no_grad():
            alias.mul_(2.0)  # in place through the alias: the copy follows (shared version counter)
        assert torch.equal(cache.get(alias), p.detach().to(BF16)) and cache.refreshes == 2
    for not_it in (p.detach(), p.detach().clone(), p.detach()[1:], p.detach().double()):
        assert cache.find(not_it) is None  # the same memory or values, but not a lent alias
        with pytest.raises(KeyError, match="was never added"):
            cache.get(not_it)


def test_a_parameter_the_cache_never_saw_is_cast_per_call_with_a_warning(gen: torch.Generator,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A parameter replaced after conversion (``load_state_dict(assign=True)``, a wrapper that swaps
    parameters in): the linear casts it per call, as with ``CAST_ONCE`` off (same bits), and warns once,
    naming itself."""
    monkeypatch.setattr(bf16_linear, "_direct", lambda x, weight: True)
    first, _ = _linears(gen)
    plain = Bf16Scheme().convert_linear(_copy(first), "ref")
    linear = Bf16Scheme().convert_linear(_copy(first), "blocks.3.uvqk")
    monkeypatch.setattr(bf16_linear, "CAST_ONCE", True)
    linear.load_state_dict(plain.state_dict(), assign=True)  # new Parameters, never added
    x = torch.randn(20, 32, generator=gen).to(BF16)
    with pytest.warns(UserWarning, match=r"blocks\.3\.uvqk.*weight, bias.*cast at each call"):
        y = linear(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(linear(x), y)  # once per linear
    monkeypatch.setattr(bf16_linear, "CAST_ONCE", False)
    assert torch.equal(plain(x), y) and linear.cast_cache.refreshes == 0
