"""``gem_kernels.sequence_input_triton`` against a float64 computation written a sequence at a time from
the definition (and ``sequence_input_reference`` against the same).

Fresh random rows, tables and output gradients per test (the ``gen`` fixture prints its seed); fresh
memory is NaN (``poison``: ``torch.empty`` in the module), so an output or gradient element the kernels
do not write fails. ``CHUNK`` is 4 rows, ``POS_BLOCK`` 4 positions, ``COL_BLOCK`` 16 columns here: a
sequence spans up to four forward programs, the backward's position blocks see from five sequences to
none, and 48 columns are three column blocks. Tolerances (relative, Frobenius): 1e-2 where the output
or a gradient is bf16, 1e-5 in fp32; the position table's gradient is float32 sums.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Set

import pytest
import torch

pytest.importorskip("triton")

from gem_kernels import sequence_input_triton as si
from gem_kernels.row_blocks import MAX_DIM
from gem_kernels.testing import offsets_from_lengths, relative_error

pytestmark = pytest.mark.usefixtures("poison")
HISTORIES = [3, 0, 11, 1, 6]  # an empty history (without context token and candidate, an empty sequence)
TOLERANCE = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
NAMES = ("item", "action", "first", "last", "position")
ALL = frozenset(NAMES)
F32, BF16 = torch.float32, torch.bfloat16


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(si, "CHUNK", 4)
    monkeypatch.setattr(si, "POS_BLOCK", 4)
    monkeypatch.setattr(si, "COL_BLOCK", 16)


def _inputs(gen: torch.Generator, hist: list[int], dim: int, rows: torch.dtype, given: set[str],
            table_rows: int, edge: torch.dtype) -> dict[str, torch.Tensor | None]:  # fmt: skip
    """item (always), and of action, first, last, position those ``given``: rows of varied scale in
    ``rows`` (first and last in ``edge``), the table in float32."""
    shapes = {"item": (sum(hist), dim), "action": (sum(hist), dim), "first": (len(hist), dim),
              "last": (len(hist), dim), "position": (table_rows, dim)}  # fmt: skip
    types = {"item": rows, "action": rows, "first": edge, "last": edge, "position": F32}
    out: dict[str, torch.Tensor | None] = {}
    for name in NAMES:
        if name == "item" or name in given:
            t = torch.randn(shapes[name], generator=gen) * (0.5 + torch.rand(shapes[name][0], 1, generator=gen) * 3)
            out[name] = t.to(types[name])
        else:
            out[name] = None
    return out


def _by_sequence(t: dict[str, torch.Tensor | None], hist: list[int], scale: float) -> torch.Tensor:
    """The definition in float64, a sequence at a time: [first[b]], item * scale + action of its history,
    [last[b]], each row plus position[p] at its position p."""
    sequences, start = [], 0
    item, action, first, last, position = (t[n] for n in NAMES)
    for b, n in enumerate(hist):
        rows = item[start : start + n].double() * scale
        if action is not None:
            rows = rows + action[start : start + n].double()
        parts = ([first[b : b + 1].double()] if first is not None else []) + [rows]
        parts += [last[b : b + 1].double()] if last is not None else []
        seq = torch.cat(parts)
        if position is not None:
            seq = seq + position[: seq.shape[0]].double()
        sequences.append(seq)
        start += n
    return torch.cat(sequences)


def _check(gen: torch.Generator, *, hist: list[int] = HISTORIES, dim: int = 48, rows: torch.dtype = F32,
           dtype: torch.dtype = F32, scale: float = 2.5, given: Set[str] = ALL, needs: Set[str] = ALL,
           table_rows: int | None = None, edge: torch.dtype | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """Forward and the gradients of the inputs in ``needs`` against float64; returns the gradients."""
    lead_tail = len({"first", "last"} & given)
    max_len = max(hist) + lead_tail
    table_rows = table_rows or max_len
    t = _inputs(gen, hist, dim, rows, given, table_rows, edge or rows)
    leaves = {n: v.clone().requires_grad_(n in needs) for n, v in t.items() if v is not None}
    hist_lengths, hist_offsets = torch.tensor(hist), offsets_from_lengths(hist)
    options = {"scale": scale, "max_len": max_len}
    call = {n: leaves.get(n) for n in NAMES[2:]}
    x = si.sequence_input_triton(leaves["item"], leaves.get("action"), hist_lengths, hist_offsets, dtype=dtype,
                                 **call, **options)  # fmt: skip
    exact64 = {n: v.double().requires_grad_() for n, v in t.items() if v is not None}
    want = _by_sequence({n: exact64.get(n) for n in NAMES}, hist, scale)
    assert x.dtype == dtype and x.shape == (sum(hist) + len(hist) * lead_tail, dim)
    assert not x.isnan().any(), "an output element was not written"
    assert relative_error(x, want) <= TOLERANCE[dtype]
    # the reference in dtype: the same float32 values (the GPU may fuse item * scale + action)
    ref = si.sequence_input_reference(t["item"], t["action"], hist_lengths, hist_offsets, dtype=dtype,
                                      **{n: t[n] for n in NAMES[2:]}, **options)  # fmt: skip
    torch.testing.assert_close(x.float(), ref.float(), rtol=2**-7 if dtype == BF16 else 1e-5, atol=1e-5)
    # and in float64: the float64 definition, its gradients too (what the benchmark checks against)
    ref64 = si.sequence_input_reference(exact64["item"], exact64.get("action"), hist_lengths, hist_offsets,
                                        dtype=torch.float64, **{n: exact64.get(n) for n in NAMES[2:]}, **options)  # fmt: skip
    torch.testing.assert_close(ref64, want, rtol=1e-12, atol=1e-12)
    upstream = torch.randn(x.shape, generator=gen).to(dtype)
    wrt = [n for n in NAMES if n in leaves and n in needs]
    grads = torch.autograd.grad((x.double() * upstream.double()).sum(), [leaves[n] for n in wrt])
    got = dict(zip(wrt, grads, strict=True))
    exact = torch.autograd.grad((want * upstream.double()).sum(), [exact64[n] for n in wrt])
    exact_ref = torch.autograd.grad((ref64 * upstream.double()).sum(), [exact64[n] for n in wrt])
    for (name, g), e, r in zip(got.items(), exact, exact_ref, strict=True):
        assert g.dtype == t[name].dtype and g.shape == t[name].shape, name  # type: ignore[union-attr]
        assert not g.isnan().any(), f"d{name}: an element was not written"
        tolerance = TOLERANCE[BF16 if BF16 in (g.dtype, dtype) else F32]
        assert relative_error(g, e) <= tolerance, f"d{name}"
        torch.testing.assert_close(r, e, rtol=1e-12, atol=1e-12)
    if "position" in got:  # rows no sequence reaches: exactly zero
        assert torch.equal(got["position"][max_len:], torch.zeros(table_rows - max_len, dim)) and table_rows >= max_len
    return got


COMBINATIONS = [set(c) for c in itertools.product(["first", ""], ["last", ""], ["position", ""], ["action", ""])]


@pytest.mark.parametrize("given", COMBINATIONS, ids=lambda g: "+".join(sorted(g - {""})) or "item-only")
def test_every_combination_fp32(gen: torch.Generator, given: set[str]) -> None:
    # 48 columns: not a power of two; histories 0 to 11 rows: up to four chunks of 4
    _check(gen, given=given - {""} | {"item"})


@pytest.mark.parametrize(("rows", "dtype", "edge"), [(BF16, BF16, BF16), (BF16, F32, BF16), (F32, BF16, F32),
                                                     (BF16, BF16, F32)],
                         ids=["bf16", "bf16-to-fp32", "fp32-to-bf16", "bf16-fp32-edges"])  # fmt: skip
@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("given", [ALL, {"action", "last", "position"}], ids=["all", "candidate"])
def test_dtypes(gen: torch.Generator, rows: torch.dtype, dtype: torch.dtype, edge: torch.dtype, scale: float,
                given: set[str]) -> None:  # fmt: skip
    # bf16 rows with the float32 position table; the context token and candidate in their own dtype
    _check(gen, rows=rows, dtype=dtype, edge=edge, scale=scale, given=given, dim=32)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor | None, ...]]:
    """The gradients the autograd Function's backward returns, call by call."""
    seen: list[tuple[torch.Tensor | None, ...]] = []
    backward = si._SequenceInput.backward

    def spy(ctx: object, dx: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = backward(ctx, dx)
        seen.append(out)
        return out

    monkeypatch.setattr(si._SequenceInput, "backward", staticmethod(spy))
    return seen


@pytest.mark.parametrize("needs", [{"item"}, {"position"}, {"first", "last"}, {"action", "position"},
                                   {"item", "last", "position"}, {"item", "action"}],
                         ids=["item", "position", "first+last", "action+position", "item+last+position",
                              "item+action"])  # fmt: skip
@pytest.mark.parametrize("scale", [1.0, 2.5])
def test_some_inputs_need_no_grad(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, needs: set[str],
                                  scale: float) -> None:  # fmt: skip
    seen = _spy(monkeypatch)
    _check(gen, needs=needs, scale=scale, dim=32)
    assert [[g is not None for g in out[:5]] for out in seen] == [[n in needs for n in NAMES]]
    assert all(g is None for g in seen[0][5:])
    # scale 1 with both needed: one tensor written and returned for both
    shared = seen[0][0] is not None and seen[0][0] is seen[0][1]
    assert shared == (needs >= {"item", "action"} and scale == 1.0)


def test_a_shared_gradient_accumulates_safely(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _spy(monkeypatch)
    item, action = torch.randn(21, 32, generator=gen), torch.randn(21, 32, generator=gen)
    leaves = [item.requires_grad_(), action.requires_grad_()]
    lengths = torch.tensor(HISTORIES)
    for _ in range(2):  # twice: the second backward adds into the leaves' .grad in place
        x = si.sequence_input_triton(*leaves, lengths, offsets_from_lengths(HISTORIES), scale=1.0, first=None,
                                     last=None, position=None, dtype=F32, max_len=11)  # fmt: skip
        x.backward(torch.ones_like(x))
    assert seen[0][0] is seen[0][1]
    assert item.grad is not None and action.grad is not None and item.grad.data_ptr() != action.grad.data_ptr()
    assert torch.equal(item.grad, torch.full((21, 32), 2.0)) and torch.equal(action.grad, torch.full((21, 32), 2.0))


@pytest.mark.parametrize(("hist", "given"), [([0, 0, 7, 0], {"action", "position"}), ([0, 0, 7, 0], ALL),
                                             ([13], ALL), ([0, 0, 1], {"last", "position"}),
                                             ([5, 5, 5], {"first", "position"})],
                         ids=["empty-sequences", "empty-histories", "one-sequence", "histories-0-0-1",
                              "equal-lengths"])  # fmt: skip
def test_edge_layouts(gen: torch.Generator, hist: list[int], given: set[str]) -> None:
    _check(gen, hist=hist, given=given, dim=32)


def test_table_longer_than_every_sequence(gen: torch.Generator) -> None:
    d_position = _check(gen, table_rows=40)["position"]  # positions 0 .. 12 used of 40: the rest zeros
    assert d_position.shape == (40, 48) and d_position[:13].abs().sum(1).gt(0).all()


@pytest.mark.parametrize("at_once", [1, 4])
def test_sequences_at_once(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, at_once: int) -> None:
    monkeypatch.setattr(si, "SEQUENCES", at_once)
    _check(gen, dim=32)


def test_default_blocks(gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("CHUNK", 128), ("POS_BLOCK", 16), ("COL_BLOCK", 128)):
        monkeypatch.setattr(si, name, value)
    _check(gen, rows=BF16, dtype=BF16, dim=32, table_rows=20)


def test_no_rows() -> None:
    assert torch.empty(4).isnan().all()  # the poison is on: unwritten outputs would show
    item, table = torch.empty(0, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    x = si.sequence_input_triton(item, None, torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64),
                                 scale=1.0, first=None, last=None, position=table, dtype=BF16, max_len=5)  # fmt: skip
    assert x.shape == (0, 8) and x.dtype == BF16
    d_item, d_table = torch.autograd.grad(x.sum(), (item, table))
    assert d_item.shape == (0, 8) and torch.equal(d_table, torch.zeros(6, 8))


def test_longer_than_max_len_shows(gen: torch.Generator) -> None:
    hist = [2, 9, 2, 2]  # with the candidate, 3, 10, 3 and 3 rows: sequence 1 is rows 3 .. 12
    item, last = torch.randn(15, 32, generator=gen), torch.randn(4, 32, generator=gen)
    args = (item, None, torch.tensor(hist), offsets_from_lengths(hist))
    for max_len, table in ((5, None), (10, torch.randn(6, 32, generator=gen))):  # max_len, then the table short
        options = {"scale": 1.0, "first": None, "last": last, "position": table, "dtype": F32, "max_len": max_len}
        x = si.sequence_input_triton(*args, **options)  # type: ignore[arg-type]
        assert x[3:11].isnan().all() and not x[:3].isnan().any() and not x[13:].isnan().any()


def _call(**change: object) -> Callable[[], object]:
    args: dict[str, object] = {"item": torch.randn(6, 8), "action": torch.randn(6, 8),
                               "hist_lengths": torch.tensor([2, 4]), "hist_offsets": offsets_from_lengths([2, 4]),
                               "scale": 1.0, "first": torch.randn(2, 8), "last": torch.randn(2, 8, dtype=BF16),
                               "position": torch.randn(6, 8), "dtype": BF16, "max_len": 6}  # fmt: skip
    args.update(change)
    return lambda: si.sequence_input_triton(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(("change", "message"), [
    ({"item": torch.randn(6)}, r"item must be rows \[Nh, D\]"),
    ({"item": torch.randn(6, MAX_DIM + 1), "action": None, "first": None, "last": None, "position": None},
     f"item must be rows .* D <= {MAX_DIM}"),
    ({"item": torch.ones(6, 8, dtype=torch.int32)}, "item must be rows .* bf16"),
    ({"action": torch.randn(5, 8)}, r"action must be item's torch.float32 \(6, 8\)"),
    ({"action": torch.randn(6, 8, dtype=BF16)}, "action must be item's torch.float32"),
    ({"hist_lengths": torch.tensor([2, 4], dtype=torch.int32)}, r"hist_lengths must be int64 \[B\]"),
    ({"hist_lengths": torch.tensor([[2, 4]])}, r"hist_lengths must be int64 \[B\]"),
    ({"hist_offsets": offsets_from_lengths([2, 4], torch.int32)}, r"hist_offsets must be int64 \[B \+ 1\]"),
    ({"hist_offsets": offsets_from_lengths([2, 4, 0])}, r"hist_offsets must be int64 \[B \+ 1\] = \[3\]"),
    ({"first": torch.randn(3, 8)}, r"first must be a float \[B, D\] = \[2, 8\]"),
    ({"last": torch.ones(2, 8, dtype=torch.int64)}, r"last must be a float \[B, D\]"),
    ({"position": torch.randn(6, 7)}, r"position must be a float table \[P, 8\]"),
    ({"position": torch.randn(0, 8)}, r"position must be a float table \[P, 8\] with P >= 1"),
    ({"position": torch.randn(6)}, r"position must be a float table"),
    ({"position": torch.ones(6, 8, dtype=torch.int64)}, r"position must be a float table"),
    ({"dtype": torch.int32}, "dtype must be bf16, fp16 or fp32"),
    ({"max_len": 0}, "max_len must bound every output length"),
    ({"max_len": 4}, "max_len must bound every output length"),  # 10 rows in 2 sequences of at most 4
    ({"max_len": 5.0}, "max_len must bound every output length"),
])  # fmt: skip
def test_bad_inputs_name_the_argument(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=f"sequence_input_triton: {message}"):
        _call(**change)()
    _call()()  # the unchanged arguments are fine
