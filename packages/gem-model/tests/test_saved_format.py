"""The HSTU block's side of ``gem_model.saved_format``: it is a ``SavedFormatBlock``, says per forward
whether its fused kernels store what they save in ``saved_format``, and passes the format to the fused
block's function only then."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

from gem_model.api import E4M3_ROW, SAVED_FORMATS, SavedFormatBlock
from gem_model.model.hstu import HSTUBlock
from gem_model.testing import LoopAttention, TorchNormGate


class FusingAttention(LoopAttention):
    """Offers a fused block that records the keyword arguments of each call and returns its input."""

    name: ClassVar[str] = "fusing"
    saved_formats: ClassVar[tuple[str, ...]] = (E4M3_ROW,)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def fused_block(self, norm_gate):
        def block(x, uvqk, out, gate_weight, gate_bias, seq_offsets, **options):
            self.calls.append(options)
            return x

        return block


class FusingWithoutFormats(FusingAttention):
    saved_formats: ClassVar[tuple[str, ...]] = ()


def hstu(attention) -> HSTUBlock:
    return HSTUBlock(dim=8, num_heads=1, attention_dim=4, value_dim=4, max_seq_len=8, max_attn_len=0, alpha=1.0,
                     dropout=0.0, attention=attention, norm_gate=TorchNormGate())  # fmt: skip


def run(block: HSTUBlock) -> None:
    block(torch.randn(5, 8), torch.tensor([0, 2, 5]), None)


def test_the_block_passes_its_saved_format_to_a_fused_block_that_offers_it():
    attention = FusingAttention()
    block = hstu(attention)
    assert isinstance(block, SavedFormatBlock) and block.saved_format is None and E4M3_ROW in SAVED_FORMATS
    assert not block.saves_in_kernels()
    run(block)
    block.saved_format = E4M3_ROW
    assert block.saves_in_kernels()
    run(block)
    assert "saved_format" not in attention.calls[0] and attention.calls[1]["saved_format"] == E4M3_ROW


@pytest.mark.parametrize("path", ["kernel without the format", "fuse off", "op by op kernel"])
def test_no_format_reaches_a_path_that_cannot_store_it(path: str):
    attention = {"kernel without the format": FusingWithoutFormats(), "fuse off": FusingAttention(),
                 "op by op kernel": LoopAttention()}[path]  # fmt: skip
    block = hstu(attention)
    block.saved_format = E4M3_ROW
    block.fuse = path != "fuse off"
    assert not block.saves_in_kernels()
    run(block)
    fused_calls = getattr(attention, "calls", [])
    assert [c for c in fused_calls if "saved_format" in c] == []
    assert len(fused_calls) == (1 if path == "kernel without the format" else 0)
