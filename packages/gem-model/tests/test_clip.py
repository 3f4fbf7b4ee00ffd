"""gem_model.train.clip: the global-norm clip of the core step."""

from __future__ import annotations

import torch

from gem_model.train.clip import clip_grad_norm


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5, 3, generator=g)) for _ in range(3)]
    for p in params[:2]:  # the third has no gradient: it is left alone
        p.grad = torch.randn(p.shape, generator=g) * 4
    return params


def test_plain_tensors_clip_exactly_as_torch_does():
    ours, theirs = _params(0), _params(0)
    norm = clip_grad_norm(ours, 0.5)
    expect = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert torch.equal(norm, expect) and norm > 0.5
    for a, b in zip(ours, theirs, strict=True):
        assert (a.grad is None and b.grad is None) or torch.equal(a.grad, b.grad)
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ours if p.grad is not None]))
    torch.testing.assert_close(total, torch.tensor(0.5), rtol=1e-5, atol=0)


def test_no_gradients_no_change():
    params = [torch.nn.Parameter(torch.ones(2))]
    assert float(clip_grad_norm(params, 1.0)) == 0.0 and params[0].grad is None
