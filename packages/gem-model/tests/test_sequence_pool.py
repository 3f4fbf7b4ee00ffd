"""The ``sequence_pool`` op: the core's ``torch`` kernel against a per-sequence float64 loop, its input
checks, its registration, and the model calling the run's kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gem_model.config import ModelConfig, RunConfig
from gem_model.data.balance import RoundRobinBalancer
from gem_model.data.loader import ShardedLoader
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.errors import UnknownNameError
from gem_model.jagged import offsets_of
from gem_model.model.gem import GemModel
from gem_model.model.sequence_pool import TorchSequencePool, check_sequence_pool_inputs, sequence_pool_torch
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components
from gem_model.testing import LoopAttention, TorchNormGate


def loop_reference(x, weight, bias, eps, hist_lengths, *, lead, candidate):
    """One sequence at a time in float64: the rows, the history slice, its last row and mean."""
    y = F.layer_norm(x.double(), (x.shape[1],), weight.double(), bias.double(), eps)
    hist, last, mean, start = [], [], [], 0
    for n in hist_lengths.tolist():
        size = lead + n + int(candidate)
        rows = y[start : start + size]
        hist.append(rows[lead : lead + n])
        last.append(rows[-1] if size else y.new_zeros(x.shape[1]))
        mean.append(rows[lead : lead + n].mean(0) if n else y.new_zeros(x.shape[1]))
        start += size
    return torch.cat(hist), torch.stack(last), torch.stack(mean)


@pytest.mark.parametrize("lead,candidate", [(0, True), (1, True), (0, False), (1, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_kernel_matches_a_loop_over_sequences(lead, candidate, dtype):
    gen = torch.Generator().manual_seed(11 + 2 * lead + int(candidate))
    hist_lengths = torch.tensor([3, 0, 5, 1])  # an empty history; with lead 0 and no candidate, an empty sequence
    lengths = hist_lengths + lead + int(candidate)
    d = 24
    x = torch.randn(int(lengths.sum()), d, generator=gen).to(dtype).requires_grad_()
    weight = (1 + 0.3 * torch.randn(d, generator=gen)).requires_grad_()
    bias = (0.2 * torch.randn(d, generator=gen)).requires_grad_()
    got = sequence_pool_torch(x, weight, bias, 1e-5, offsets_of(lengths), hist_lengths, lead=lead, candidate=candidate)
    want = loop_reference(x.detach(), weight.detach(), bias.detach(), 1e-5, hist_lengths, lead=lead, candidate=candidate)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for name, g, w in zip(("hist", "last", "mean"), got, want, strict=True):
        assert g.dtype == dtype, name
        torch.testing.assert_close(g.double(), w, **tol, msg=lambda m, name=name: f"{name}: {m}")
    # the gradients through all three outputs, against the loop's in float64
    grads = [torch.randn(g.shape, generator=gen) for g in got]
    torch.autograd.backward([g.float() for g in got], grads)
    x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, weight, bias))
    ref = loop_reference(x64, w64, b64, 1e-5, hist_lengths, lead=lead, candidate=candidate)
    torch.autograd.backward(list(ref), [g.double() for g in grads])
    for name, g, w in (("x", x.grad, x64.grad), ("weight", weight.grad, w64.grad), ("bias", bias.grad, b64.grad)):
        scale = w.abs().max().item()
        assert (g.double() - w).abs().max().item() <= (1e-4 if dtype == torch.float32 else 3e-2) * scale, name


def test_bad_inputs_are_refused_by_name():
    lengths = torch.tensor([2, 1])
    with pytest.raises(ValueError, match=r"x must be \[N, D\]"):
        check_sequence_pool_inputs(torch.zeros(5), offsets_of(lengths), lengths, lead=0)
    with pytest.raises(ValueError, match="lead must be 0 or 1"):
        check_sequence_pool_inputs(torch.zeros(5, 4), offsets_of(lengths), lengths, lead=2)
    with pytest.raises(ValueError, match=r"offsets must be \[B \+ 1\] for the 2 history lengths"):
        check_sequence_pool_inputs(torch.zeros(5, 4), offsets_of(lengths)[:-1], lengths, lead=0)


def test_torch_is_registered_and_the_default():
    assert RunConfig().kernels.sequence_pool.name == "torch"
    pm = GemPluginManager(autoload=False)  # gem-model's own components only
    assert pm.kernel_registry("sequence_pool").get("torch").cls is TorchSequencePool
    unknown = RunConfig.model_validate({"kernels": {"sequence_pool": {"name": "triton"}}})
    with pytest.raises(UnknownNameError, match=r"(?s)kernels\.sequence_pool.*pip install gem-kernels"):
        resolve_components(unknown, pm)


class HalvedMean(TorchSequencePool):
    """The core's pool with the mean halved, recording what it was called with."""

    name = "halved_mean"

    def __init__(self, config=None):
        super().__init__(config)
        self.calls: list[dict] = []

    def __call__(self, x, weight, bias, eps, offsets, hist_lengths, **kwargs):
        self.calls.append(kwargs)
        hist, last, mean = super().__call__(x, weight, bias, eps, offsets, hist_lengths, **kwargs)
        return hist, last, mean * 0.5


@pytest.mark.parametrize("context_token", [False, True])
def test_the_model_pools_with_its_kernel(context_token):
    src = SyntheticSource(SyntheticConfig(max_len=31))
    cfg = ModelConfig(max_seq_len=33, context_token=context_token)
    model = GemModel(cfg, src.feature_spec(), attention=LoopAttention(), norm_gate=TorchNormGate())
    assert type(model.pool_kernel) is TorchSequencePool  # not given: the core's torch kernel
    batch = next(ShardedLoader(src, RoundRobinBalancer(), global_batch_size=6))
    model.eval()
    enc = model.encode(batch)
    halved = HalvedMean()
    model.pool_kernel = halved
    got = model.encode(batch)
    assert halved.calls == [{"lead": int(context_token), "candidate": True, "max_len": 33}]
    assert torch.equal(got["hist_out"], enc["hist_out"]) and torch.equal(got["summary"], enc["summary"])
    # the tokens are [summary, mean, ...]: the mean is what the kernel returned
    torch.testing.assert_close(got["tokens"][:, 1], enc["tokens"][:, 1] * 0.5)
