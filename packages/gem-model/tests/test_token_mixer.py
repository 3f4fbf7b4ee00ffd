"""The token mixers' attention (``gem_model.model.hstu.TokenMixer``): the layer against a float64 reference
written out by hand, on torch's own SDPA choice (the default) and on the backends without cuDNN (the e2e
switch ``mixer_no_cudnn``), forward and the input's gradient; and a ``MIXER_SDPA_BACKENDS`` list is what SDPA
may use (a list without a CPU kernel fails)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from gem_model.model import hstu
from gem_model.model.hstu import TokenMixer


def reference(mixer: TokenMixer, x: torch.Tensor) -> torch.Tensor:
    """The mixer in float64, its attention as ``softmax(q k^T / sqrt(d_head)) v``."""
    p = {name: t.detach().double() for name, t in mixer.named_parameters()}
    x = x.double()
    b, t, d = x.shape
    h = mixer.num_heads
    qkv = F.linear(F.layer_norm(x, (d,), p["norm1.weight"], p["norm1.bias"]), p["qkv.weight"], p["qkv.bias"])
    q, k, v = qkv.reshape(b, t, 3, h, d // h).permute(2, 0, 3, 1, 4).unbind(0)
    a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // h), dim=-1) @ v
    x = x + F.linear(a.transpose(1, 2).reshape(b, t, d), p["proj.weight"], p["proj.bias"])
    hidden = F.gelu(F.linear(F.layer_norm(x, (d,), p["norm2.weight"], p["norm2.bias"]), p["fc1.weight"], p["fc1.bias"]))
    return x + F.linear(hidden, p["fc2.weight"], p["fc2.bias"])


NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@pytest.mark.parametrize("backends", [None, NO_CUDNN], ids=["torch_choice", "no_cudnn"])
def test_the_mixer_matches_a_float64_reference_forward_and_backward(monkeypatch, backends):
    monkeypatch.setattr(hstu, "MIXER_SDPA_BACKENDS", backends)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    mixer = TokenMixer(32, 4, dropout=0.0)
    with torch.no_grad():
        for param in mixer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    x = torch.randn(3, 7, 32, generator=gen, requires_grad=True)
    grad = torch.randn(3, 7, 32, generator=gen)
    got = mixer(x)
    got.backward(grad)
    ref_x = x.detach().double().requires_grad_()
    ref_mixer = TokenMixer(32, 4, dropout=0.0).double()
    ref_mixer.load_state_dict({k: v.double() for k, v in mixer.state_dict().items()})
    want = reference(ref_mixer, ref_x)
    want.backward(grad.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=1e-4, atol=1e-4)
    assert not torch.equal(got, x)  # the layer did something


def test_sdpa_runs_only_on_the_listed_backends(monkeypatch):
    monkeypatch.setattr(hstu, "MIXER_SDPA_BACKENDS", [SDPBackend.CUDNN_ATTENTION])  # no CPU kernel
    with pytest.raises(RuntimeError, match="No (viable backend|available kernel)"):
        TokenMixer(16, 2, dropout=0.0)(torch.randn(2, 5, 16))
