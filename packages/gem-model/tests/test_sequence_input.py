"""The ``sequence_input`` op: the core's ``torch`` kernel against a per-sequence float64 loop, its input
checks, its registration, and the model assembling its rows with the run's kernel."""

from __future__ import annotations

import pytest
import torch

from gem_model.config import ModelConfig, RunConfig
from gem_model.data.balance import RoundRobinBalancer
from gem_model.data.loader import ShardedLoader
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_model.errors import UnknownNameError
from gem_model.model.gem import GemModel
from gem_model.model.sequence_input import TorchSequenceInput, check_sequence_input_inputs, sequence_input_torch
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components
from gem_model.testing import LoopAttention, TorchNormGate


def loop_reference(item, action, hist_lengths, *, scale, first, last, position):
    """One sequence at a time in float64: [first], item * scale + action of the history, [last]; + position."""
    rows, start = [], 0
    for b, n in enumerate(hist_lengths.tolist()):
        hist = item[start : start + n].double() * scale
        if action is not None:
            hist = hist + action[start : start + n].double()
        parts = ([first[b : b + 1].double()] if first is not None else []) + [hist]
        parts += [last[b : b + 1].double()] if last is not None else []
        seq = torch.cat(parts)
        if position is not None:
            seq = seq + position[: seq.shape[0]].double()
        rows.append(seq)
        start += n
    return torch.cat(rows)


CASES = [  # (first, last, position, action, scale)
    (False, True, True, True, 1.0),  # the big config's
    (True, True, True, True, 1.0),  # with a context token
    (True, False, False, False, 2.5),
    (False, False, True, True, 2.5),
]


@pytest.mark.parametrize("has_first,has_last,has_position,has_action,scale", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_kernel_matches_a_loop_over_sequences(has_first, has_last, has_position, has_action, scale, dtype):
    gen = torch.Generator().manual_seed(17 + int(has_first) + 2 * int(has_last))
    hist_lengths = torch.tensor([3, 0, 5, 1])
    b, d = hist_lengths.numel(), 12
    inputs = {
        "item": torch.randn(int(hist_lengths.sum()), d, generator=gen).to(dtype),
        "action": torch.randn(int(hist_lengths.sum()), d, generator=gen).to(dtype) if has_action else None,
        "first": torch.randn(b, d, generator=gen).to(dtype) if has_first else None,
        "last": torch.randn(b, d, generator=gen) if has_last else None,  # float32: the kernel casts it
        "position": torch.randn(9, d, generator=gen) if has_position else None,
    }
    leaves = {k: v.clone().requires_grad_() if v is not None else None for k, v in inputs.items()}
    got = sequence_input_torch(leaves["item"], leaves["action"], hist_lengths, scale=scale, first=leaves["first"],
                               last=leaves["last"], position=leaves["position"], dtype=dtype)  # fmt: skip
    exact = {k: v.double().requires_grad_() if v is not None else None for k, v in inputs.items()}
    want = loop_reference(exact["item"], exact["action"], hist_lengths, scale=scale, first=exact["first"],
                          last=exact["last"], position=exact["position"])  # fmt: skip
    assert got.dtype == dtype and got.shape == want.shape
    tol = 1e-6 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    grad = torch.randn(got.shape, generator=gen)
    got.float().backward(grad)
    want.backward(grad.double())
    for name, leaf in leaves.items():
        if leaf is not None:
            ref = exact[name].grad
            assert (leaf.grad.double() - ref).abs().max().item() <= tol * max(1.0, ref.abs().max().item()), name


def test_bad_inputs_are_refused_by_name():
    item, lengths = torch.zeros(5, 4), torch.tensor([2, 3])
    with pytest.raises(ValueError, match=r"item must be \[Nh, D\]"):
        check_sequence_input_inputs(torch.zeros(5), None, lengths, None, None, None)
    with pytest.raises(ValueError, match="action must have item's shape"):
        check_sequence_input_inputs(item, torch.zeros(4, 4), lengths, None, None, None)
    with pytest.raises(ValueError, match=r"last must be \[B, D\] = \[2, 4\]"):
        check_sequence_input_inputs(item, None, lengths, None, torch.zeros(3, 4), None)
    with pytest.raises(ValueError, match=r"position must be the \[P, 4\] table"):
        check_sequence_input_inputs(item, None, lengths, None, None, torch.zeros(8, 5))


def test_torch_is_registered_and_the_default():
    assert RunConfig().kernels.sequence_input.name == "torch"
    pm = GemPluginManager(autoload=False)  # gem-model's own components only
    assert pm.kernel_registry("sequence_input").get("torch").cls is TorchSequenceInput
    unknown = RunConfig.model_validate({"kernels": {"sequence_input": {"name": "triton"}}})
    with pytest.raises(UnknownNameError, match=r"(?s)kernels\.sequence_input.*pip install gem-kernels"):
        resolve_components(unknown, pm)


class Recording(TorchSequenceInput):
    """The core's kernel, recording its keyword arguments and doubling its rows."""

    name = "recording"

    def __init__(self, config=None):
        super().__init__(config)
        self.calls: list[dict] = []

    def __call__(self, item, action, hist_lengths, **kwargs):
        self.calls.append({k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)})
        self.calls[-1].update({k: tuple(v.shape) for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        return super().__call__(item, action, hist_lengths, **kwargs) * 2


@pytest.mark.parametrize("context_token", [False, True])
def test_the_model_assembles_its_rows_with_its_kernel(context_token):
    src = SyntheticSource(SyntheticConfig(max_len=31))
    cfg = ModelConfig(max_seq_len=33, context_token=context_token, scale_item_input=True)
    model = GemModel(cfg, src.feature_spec(), attention=LoopAttention(), norm_gate=TorchNormGate())
    assert type(model.input_kernel) is TorchSequenceInput  # not given: the core's torch kernel
    batch = next(ShardedLoader(src, RoundRobinBalancer(), global_batch_size=6))
    model.eval()
    before = model.encode(batch)
    recording = Recording()
    model.input_kernel = recording
    after = model.encode(batch)
    d = cfg.embedding_dim
    call = recording.calls[0]
    assert call["scale"] == d**0.5 and call["dtype"] == torch.float32 and call["max_len"] == 33
    assert call["last"] == (6, d) and call["position"] == (33, d)
    assert call.get("first") == ((6, d) if context_token else None)
    assert not torch.equal(after["hist_out"], before["hist_out"])  # the doubled rows went through the tower
