"""``gem_kernels.sequence_pool_triton`` against a float64 computation written a sequence at a time from
the definition (and ``sequence_pool_reference`` against the same).

Fresh random rows, affine parameters and output gradients per test (the ``gen`` fixture prints its
seed); fresh memory is NaN (``poison``: ``torch.empty`` in the module, its partial sums' buffer too),
so an output element the kernels do not write, or a partial sum they read without writing, fails.
``CHUNK`` is 4 rows and ``BACKWARD_ROWS`` 16 here: a sequence spans up to four forward programs and
the backward's weight and bias gradients add several programs' sums. Tolerances (relative, Frobenius):
1e-2 for bf16 (outputs and x's gradient rounded to bf16), 1e-5 for fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytest.importorskip("triton")

from gem_kernels import sequence_pool_triton as sp
from gem_kernels.row_blocks import MAX_DIM
from gem_kernels.testing import offsets_from_lengths, relative_error

pytestmark = pytest.mark.usefixtures("poison")
EPS = 1e-5
HISTORIES = [3, 0, 11, 1, 6]  # an empty history (for lead 0 without a candidate, an empty sequence)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "CHUNK", 4)
    monkeypatch.setattr(sp, "BACKWARD_ROWS", 16)


def _inputs(gen: torch.Generator, lengths: list[int], dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Rows of varied scale and a nonzero mean, random affine parameters, the offsets."""
    rows = sum(lengths)
    scale, shift = 0.5 + torch.rand(rows, 1, generator=gen) * 3, torch.randn(rows, 1, generator=gen)
    x = torch.randn(rows, dim, generator=gen) * scale + shift
    weight = torch.randn(dim, generator=gen)
    bias = torch.randn(dim, generator=gen)
    return x.to(dtype), weight, bias, offsets_from_lengths(lengths)


def _by_sequence(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, lengths: list[int], lead: int,
                 candidate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The definition in float64, a sequence at a time: the layer norm of every row, then each
    sequence's rows lead .. lead + history, its last row (zeros if empty), its history's mean."""
    x, weight, bias = x.double(), weight.double(), bias.double()
    centered = x - x.mean(1, keepdim=True)
    y = centered / torch.sqrt(centered.pow(2).mean(1, keepdim=True) + EPS) * weight + bias
    hist, last, mean, start = [], [], [], 0
    for n in lengths:
        h = n - lead - int(candidate)
        rows = y[start + lead : start + lead + h]
        hist.append(rows)
        last.append(y[start + n - 1] if n else y.new_zeros(y.shape[1]))
        mean.append(rows.mean(0) if h else y.new_zeros(y.shape[1]))
        start += n
    return torch.cat(hist), torch.stack(last), torch.stack(mean)


def _grads(outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
           upstream: dict[int, torch.Tensor]) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """Gradients of ``sum(outputs[i] * upstream[i])`` over the outputs used (the others unused)."""
    loss = sum((outputs[i].double() * g.double()).sum() for i, g in upstream.items())
    return torch.autograd.grad(loss, inputs)


def _check(gen: torch.Generator, lengths: list[int], dim: int, dtype: torch.dtype, lead: int, candidate: bool,
           used: tuple[int, ...] = (0, 1, 2)) -> None:  # fmt: skip
    x, weight, bias, offsets = _inputs(gen, lengths, dim, dtype)
    leaves = [t.clone().requires_grad_() for t in (x, weight, bias)]
    got = sp.sequence_pool_triton(*leaves, EPS, offsets, lead=lead, candidate=candidate, max_len=max(lengths) + 1)
    exact64 = [t.double().requires_grad_() for t in (x, weight, bias)]
    want = _by_sequence(*exact64, lengths, lead, candidate)
    count = sum(lengths) - len(lengths) * (lead + int(candidate))
    for out, shape in zip(got, [(count, dim), (len(lengths), dim), (len(lengths), dim)], strict=True):
        assert out.dtype == dtype and out.shape == shape
        assert not out.isnan().any(), "an output element was not written"
    tolerance = TOLERANCE[dtype]
    for name, out, exact in zip(("hist", "last", "mean"), got, want, strict=True):
        assert relative_error(out, exact) <= tolerance, name
    # the reference in x's dtype: the same float32 values, at most a rounding step apart
    ref = sp.sequence_pool_reference(x, weight, bias, EPS, offsets, lead=lead, candidate=candidate, max_len=0)
    for out, r in zip(got, ref, strict=True):
        torch.testing.assert_close(out.float(), r.float(), rtol=2**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    upstream = {i: torch.randn(got[i].shape, generator=gen).to(dtype) for i in used}
    grads = _grads(got, tuple(leaves), upstream)
    exact_grads = _grads(want, tuple(exact64), upstream)
    for name, g, exact in zip(("x", "weight", "bias"), grads, exact_grads, strict=True):
        assert g.dtype == (dtype if name == "x" else torch.float32) and not g.isnan().any(), name
        assert relative_error(g, exact) <= tolerance, f"d{name}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("lead", "candidate"), [(0, True), (1, True), (0, False), (1, False)],
                         ids=["candidate", "context+candidate", "plain", "context"])  # fmt: skip
def test_matches_float64(gen: torch.Generator, lead: int, candidate: bool, dtype: torch.dtype) -> None:
    # 48 columns: not a power of two; histories 0 to 11 rows: up to four chunks of 4
    lengths = [h + lead + int(candidate) for h in HISTORIES]
    _check(gen, lengths, 48, dtype, lead, candidate)


@pytest.mark.parametrize(
    "used", [(0,), (2,), (1,), (0, 1), (1, 2)], ids=["hist", "mean", "last", "hist+last", "last+mean"]
)
def test_some_outputs_unused(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, used: tuple[int, ...]) -> None:
    seen: list[tuple[bool, ...]] = []
    backward = sp._SequencePool.backward

    def spy(ctx: object, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        seen.append(tuple(g is not None for g in grads))
        return backward(ctx, *grads)

    monkeypatch.setattr(sp._SequencePool, "backward", staticmethod(spy))
    _check(gen, [h + 1 for h in HISTORIES], 32, torch.float32, 0, True, used)
    assert seen == [tuple(i in used for i in range(3))]  # the unused outputs' gradients: None, not zeros


@pytest.mark.parametrize(("lengths", "lead", "candidate"), [([0, 0, 7, 0], 0, False), ([13], 1, True), ([2, 2, 3], 1, True)],
                         ids=["empty-around", "one-sequence", "histories-0-0-1"])  # fmt: skip
def test_edge_layouts(gen: torch.Generator, lengths: list[int], lead: int, candidate: bool) -> None:
    _check(gen, lengths, 32, torch.float32, lead, candidate)


def test_default_chunk(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sp, "CHUNK", 128)
    monkeypatch.setattr(sp, "BACKWARD_ROWS", 128)
    _check(gen, [h + 1 for h in HISTORIES], 32, torch.bfloat16, 0, True)


def test_no_rows() -> None:
    assert torch.empty(4).isnan().all()  # the poison is on: unwritten outputs would show
    x = torch.empty(0, 8, requires_grad=True)
    weight, bias = torch.randn(8, requires_grad=True), torch.randn(8, requires_grad=True)
    hist, last, mean = sp.sequence_pool_triton(x, weight, bias, EPS, torch.zeros(4, dtype=torch.int64), lead=0,
                                               candidate=False, max_len=5)  # fmt: skip
    assert hist.shape == (0, 8) and torch.equal(last, torch.zeros(3, 8)) and torch.equal(mean, torch.zeros(3, 8))
    dx, dw, db = torch.autograd.grad((last * torch.randn(3, 8)).sum(), (x, weight, bias))
    assert dx.shape == (0, 8) and torch.equal(dw, torch.zeros(8)) and torch.equal(db, torch.zeros(8))


def test_longer_than_max_len_shows(gen: torch.Generator) -> None:
    x, weight, bias, offsets = _inputs(gen, [2, 10, 2], 32, torch.float32)  # 10 rows: 3 chunks; max_len 5: 2
    _, _, mean = sp.sequence_pool_triton(x, weight, bias, EPS, offsets, lead=0, candidate=True, max_len=5)
    assert mean[1].isnan().all() and not mean[[0, 2]].isnan().any()


def _call(**change: object) -> Callable[[], object]:
    args: dict[str, object] = {"x": torch.randn(6, 8), "weight": torch.randn(8), "bias": torch.randn(8), "eps": EPS,
                               "offsets": offsets_from_lengths([2, 4]), "lead": 0, "candidate": True, "max_len": 4}  # fmt: skip
    args.update(change)
    return lambda: sp.sequence_pool_triton(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("change", "message"), [
    ({"x": torch.randn(6)}, r"x must be rows \[N, D\]"),
    ({"x": torch.randn(6, MAX_DIM + 1)}, f"x must be rows .* D <= {MAX_DIM}"),
    ({"x": torch.ones(6, 8, dtype=torch.int32)}, "x must be rows .* bf16"),
    ({"weight": torch.randn(7)}, r"weight must be a float \[8\]"),
    ({"bias": torch.randn(1, 8)}, r"bias must be a float \[8\]"),
    ({"offsets": offsets_from_lengths([2, 4], torch.int32)}, "offsets must be int64"),
    ({"offsets": offsets_from_lengths([2, 4])[None]}, r"offsets must be int64 \[B \+ 1\]"),
    ({"lead": 2}, "lead must be 0 or 1"),
    ({"offsets": offsets_from_lengths([1] * 4), "x": torch.randn(4, 8), "lead": 1}, "x has 4 rows, fewer than"),
    ({"max_len": 0}, "max_len must bound every length"),
    ({"max_len": 2}, "max_len must bound every length"),
])  # fmt: skip
def test_bad_inputs_name_the_argument(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"sequence_pool_triton: {message}"):
        _call(**change)()
    _call()()  # the unchanged arguments are fine
