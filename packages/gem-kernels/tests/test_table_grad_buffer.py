"""The sequence input and the next-item loss writing a lookup's gradient straight into its one buffer
(:mod:`gem_model.table_grad`), against the same step on plain slices of the lookup's output (autograd's
split backward and adds: what the model ran before).

The lookup's output is one ``[rows, D]`` tensor laid out as torchrec's sequence lookup lays out the big
config's features: history items, negatives, candidates, history actions. Fresh random data (the ``gen``
fixture prints its seed); fresh memory is NaN (``poison``), the buffer's too, so a row that neither a
kernel nor the buffer's node writes fails. Both orders in which autograd may reach the two kernels are
run: the loss first (as in the model: the loss's queries come from the sequence tower), and the input
first (then the loss hands its gradient back to autograd, and the node adds it); with ``l2_normalize``
the loss writes the negatives' rows by its unit-rows backward, without it by a copy.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from gem_kernels import sequence_input_triton as si
from gem_kernels.next_item_loss_triton import shared_negatives_loss
from gem_kernels.testing import offsets_from_lengths, relative_error
from gem_model.api import grad_section, table_views

pytestmark = pytest.mark.usefixtures("poison")
HISTORIES = [3, 0, 9, 1, 6]
K, DIM = 4, 32


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(si, "CHUNK", 4)
    monkeypatch.setattr(si, "POS_BLOCK", 4)
    monkeypatch.setattr(si, "COL_BLOCK", 16)


def _step(base: torch.Tensor, context: torch.Tensor, position: torch.Tensor, up: torch.Tensor, *, one_buffer: bool,
          loss_first: bool, scale: float, dtype: torch.dtype, l2: bool) -> torch.Tensor:  # fmt: skip
    """The model's use of the lookup: the sequence's rows from items, actions and candidates, and the
    next-item loss over the history rows' outputs (``loss_first``) or over rows of their own."""
    b, nh = len(HISTORIES), sum(HISTORIES)
    sizes = [nh, b * K, b, nh]
    if one_buffer:
        item, neg, cand, action = table_views(base, sizes)
        assert grad_section(item) is not None and grad_section(neg) is not None
    else:
        item, neg, cand, action = base.split(sizes)
    lengths, offsets = torch.tensor(HISTORIES), offsets_from_lengths(HISTORIES)
    item_ids = torch.arange(nh) % 7
    negative_ids = torch.arange(b * K) % 11

    def loss_of(query: torch.Tensor) -> torch.Tensor:
        return shared_negatives_loss(query, item, neg, lengths, item_ids, negative_ids, num_negatives=K,
                                     l2_normalize=l2, temperature=0.5, host_lengths=lengths)[0]  # fmt: skip

    early = None if loss_first else loss_of(torch.tanh(up[:nh, :]).to(dtype))  # created first: run last
    x = si.sequence_input_triton(item, action, lengths, offsets, scale=scale, first=context, last=cand,
                                 position=position, dtype=dtype, max_len=max(HISTORIES) + 2)  # fmt: skip
    history = torch.cat([torch.arange(o + 1 + 2 * i, o + 1 + 2 * i + n) for i, (o, n) in
                         enumerate(zip(offsets[:-1].tolist(), HISTORIES, strict=True))])  # fmt: skip
    loss = loss_of(x[history]) if loss_first else early
    return (x.float() * up).sum() + loss


@pytest.mark.parametrize("l2", [True, False], ids=["l2", "dot"])
@pytest.mark.parametrize("loss_first", [True, False], ids=["loss-first", "input-first"])
@pytest.mark.parametrize(("rows", "scale"), [(torch.float32, 2.5), (torch.bfloat16, 1.0), (torch.bfloat16, 2.5)],
                         ids=["fp32", "bf16", "bf16-scaled"])  # fmt: skip
def test_the_kernels_write_the_buffer_as_autograd_would(gen: torch.Generator, loss_first: bool, rows: torch.dtype,
                                                        scale: float, l2: bool) -> None:  # fmt: skip
    b, nh = len(HISTORIES), sum(HISTORIES)
    total = nh * 2 + b * K + b
    data = (torch.randn(total, DIM, generator=gen) * (0.5 + torch.rand(total, 1, generator=gen))).to(rows)
    context = torch.randn(b, DIM, generator=gen).to(rows)
    position = torch.randn(max(HISTORIES) + 2, DIM, generator=gen)
    up = torch.randn(nh + 2 * b, DIM, generator=gen)
    grads = []
    for one_buffer in (True, False):
        base = data.clone().requires_grad_()
        _step(base, context, position, up, one_buffer=one_buffer, loss_first=loss_first, scale=scale,
              dtype=rows, l2=l2).backward()  # fmt: skip
        assert not base.grad.isnan().any(), "a row of the lookup's gradient was not written"
        grads.append(base.grad)
    got, want = grads
    if rows == torch.float32 or scale == 1.0:  # the same roundings: the same bits (up to the adds' order)
        torch.testing.assert_close(got, want, rtol=1e-6 if rows == torch.float32 else 0, atol=1e-7 if rows == torch.float32 else 0)
    else:  # the item rows' sum rounded once to bf16, where autograd rounds the scaled gradient first: elements
        # apart by a rounding of the addends (large against a sum that cancels), so the whole is compared
        assert relative_error(got, want) <= 2**-8
