"""``torch.compile`` around the Triton kernels: an HSTU-shaped block (projection, silu, split into
strided views, jagged attention with both relative biases, norm-gate) compiled gives what it gives
eagerly, forward and backward, and the compiled graph calls the kernels as custom ops."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gem_kernels.attention import TritonJaggedAttention
from gem_kernels.norm_gate import TritonNormGate
from gem_kernels.testing import offsets_from_lengths, relative_error
from gem_model.api import AttentionExtras

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # torch.compile of the block, forward and backward: ~20 s of CPU

HEADS, DQK, DV, DIM, MAX_LEN, BUCKETS = 2, 16, 16, 32, 24, 8


def block(x, w, offsets, targets, position, time, ts, qts, gate_w, gate_b, attention, norm_gate):
    n = x.shape[0]
    uvqk = F.silu(F.layer_norm(x, (DIM,)) @ w)
    u, v, q, k = torch.split(uvqk, [HEADS * DV, HEADS * DV, HEADS * DQK, HEADS * DQK], dim=-1)
    a = attention(
        q.reshape(n, HEADS, DQK), k.reshape(n, HEADS, DQK), v.reshape(n, HEADS, DV), offsets,
        max_seq_len=MAX_LEN, alpha=0.5, extras=AttentionExtras(num_targets=targets, position_bias=position,
                                                               time_bias=time, timestamps=ts, query_timestamps=qts),
    )
    return x + norm_gate(a.reshape(n, HEADS * DV), u, gate_w, gate_b, 1e-6)


def test_compiled_block_matches_eager_forward_and_backward(gen: torch.Generator, poison: None) -> None:
    lengths = [5, 17, 1, 9]  # one sequence of length 1, one over a 16-row tile (the interpreter is slow)
    offsets = offsets_from_lengths(lengths)
    n = int(offsets[-1])
    targets = torch.tensor([1, 2, 0, 3])
    ts = torch.cumsum(torch.randint(0, 50, (n,), generator=gen), 0)
    qts = ts + torch.randint(0, 5, (n,), generator=gen)
    leaves = {
        "x": torch.randn(n, DIM, generator=gen),
        "w": torch.randn(DIM, 2 * HEADS * (DV + DQK), generator=gen) / DIM**0.5,
        "position": torch.randn(2 * MAX_LEN - 1, generator=gen) * 0.1,
        "time": torch.randn(BUCKETS, generator=gen) * 0.1,
        "gate_w": 1 + 0.1 * torch.randn(HEADS * DV, generator=gen),
        "gate_b": 0.1 * torch.randn(HEADS * DV, generator=gen),
    }
    grad_out = torch.randn(n, DIM, generator=gen)
    attention, norm_gate = TritonJaggedAttention(), TritonNormGate()

    def run(fn):
        inputs = {name: t.clone().requires_grad_() for name, t in leaves.items()}
        out = fn(inputs["x"], inputs["w"], offsets, targets, inputs["position"], inputs["time"], ts, qts,
                 inputs["gate_w"], inputs["gate_b"], attention, norm_gate)
        grads = torch.autograd.grad(out, list(inputs.values()), grad_out)
        return out, dict(zip(inputs, grads, strict=True))

    torch._dynamo.reset()
    eager_out, eager_grads = run(block)
    compiled = torch.compile(block, fullgraph=True)  # fullgraph: no graph break around the kernels
    out, grads = run(compiled)
    assert torch.isfinite(out).all()
    # the same kernels on both sides; inductor reorders the float32 pointwise work around them
    assert relative_error(out, eager_out) < 1e-5
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert relative_error(grad, eager_grads[name]) < 1e-5, name
    assert eager_grads["position"].abs().sum() > 0 and eager_grads["time"].abs().sum() > 0


def test_fake_outputs_have_the_kernels_layout(gen: torch.Generator) -> None:
    """The compiled code asserts the strides of the fake implementations: they must be the kernels'."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gem_kernels.compiled_ops import jagged_attention_backward_op, jagged_attention_op

    offsets = offsets_from_lengths([3, 6])
    base = torch.randn(9, 3 * HEADS * DQK, generator=gen)
    q, k, v = (t.reshape(9, HEADS, DQK) for t in base.split(HEADS * DQK, dim=-1))  # strided views
    args = (offsets, None, None, None, None, None, MAX_LEN, 0.5, 0, "auto", 0, 0)
    real = jagged_attention_op(q, k, v, *args)
    real_grads = jagged_attention_backward_op(real, q, k, v, *args, False, False)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = jagged_attention_op(fq, fk, fv, *args)
        fake_grads = jagged_attention_backward_op(fake, fq, fk, fv, *args, False, False)
    for got, want in zip((fake, *fake_grads), (real, *real_grads), strict=True):
        assert (got.shape, got.stride(), got.dtype) == (want.shape, want.stride(), want.dtype)
