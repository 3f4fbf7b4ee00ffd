"""The ``bf16`` scheme's shared cast cache (:mod:`gem_precision.cast_cache`), on fresh random data.

The cached path runs only on a GPU (``bf16_linear._direct``); here ``_direct`` is forced on the CPU,
where :class:`Bf16LinearFunction` computes the same math (its ``dW`` falls back to the bf16 product
cast), so the cached and uncached forms must agree bit for bit, before and after the optimizer moves
the weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

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
