"""The contract of a linear that takes its input pre-quantized (gem_model.prequantized): its values check
what they are given and say what was wrong, a callable without the method gets a plain call, and the
HSTU block hands its fused path the output linear itself only when no active dropout sits in between."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gem_model.api import (
    PrequantizedInputLinear,
    PrequantizedRows,
    RowQuantization,
    call_linear,
    wanted_quantization,
)
from gem_model.model.hstu import HSTUBlock
from gem_model.testing import LoopAttention, TorchNormGate

E4M3 = torch.float8_e4m3fn


def rows(m: int = 5, n: int = 8, *, amax: bool = True) -> PrequantizedRows:
    return PrequantizedRows(
        torch.zeros(m, n, dtype=E4M3), torch.ones(m), torch.zeros(n, dtype=torch.int32) if amax else None
    )


class Recording(nn.Module):
    """A linear that takes rows: records what each call got."""

    def __init__(self, wanted: object) -> None:
        super().__init__()
        self.wanted, self.calls = wanted, []

    def input_quantization(self, device: torch.device) -> object:
        return self.wanted

    def forward(self, x: torch.Tensor, *, prequantized: PrequantizedRows | None = None) -> torch.Tensor:
        self.calls.append(prequantized)
        return x * 2


def test_the_rule_is_torchs_e4m3fn():
    info = torch.finfo(E4M3)
    assert info.max == RowQuantization.MAX == 1.75 * 2**RowQuantization.EMAX
    assert info.tiny == RowQuantization.MIN_NORMAL and info.eps == 2.0**-RowQuantization.MANTISSA_BITS
    assert RowQuantization.DTYPE == E4M3
    nan = torch.tensor([RowQuantization.NAN_BYTE], dtype=torch.uint8).view(E4M3).float()
    nan_scale = torch.tensor([RowQuantization.NAN_SCALE_BITS], dtype=torch.int32).view(torch.float32)
    assert nan.isnan().all() and nan_scale.isnan().all()
    # 1.75 (the fraction of 448) is where one more bit of scale would overflow
    fraction = torch.tensor([1.75], dtype=torch.float32).view(torch.int32) & 0x7FFFFF
    assert int(fraction) == RowQuantization.MAX_FRACTION_BITS


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        ({"data": torch.zeros(5, 8)}, r"data must be torch.float8_e4m3fn \[M, N\].*torch.float32 \(5, 8\)"),
        ({"data": torch.zeros(8, 5, dtype=E4M3).t()}, r"data must be .* with contiguous rows, .* strides \(1, 5\)"),
        ({"scale_inv": torch.ones(4)}, r"scale_inv must be float32 \[5\], got torch.float32 \(4,\)"),
        ({"scale_inv": torch.ones(5, dtype=torch.float64)}, r"scale_inv must be float32 \[5\], got torch.float64"),
        ({"column_amax_bits": torch.zeros(8)}, r"column_amax_bits must be int32 \[8\], got torch.float32 \(8,\)"),
        ({"column_amax_bits": torch.zeros(5, dtype=torch.int32)}, r"column_amax_bits must be int32 \[8\].*\(5,\)"),
        ({"scale_inv": torch.ones(5, device="meta")}, r"every part must be on data's device cpu, found meta"),
    ],
)
def test_prequantized_rows_say_which_part_is_wrong(parts, message):
    good = {"data": torch.zeros(5, 8, dtype=E4M3), "scale_inv": torch.ones(5), "column_amax_bits": None}
    with pytest.raises(ValueError, match=message):
        PrequantizedRows(**{**good, **parts})


def test_prequantized_rows_check_the_input_they_stand_for():
    r = rows(6, 8)
    r.check_input(torch.zeros(2, 3, 8), "blocks.0.uvqk")  # leading dims flatten into the rows
    with pytest.raises(ValueError, match=r"blocks.0.uvqk: pre-quantized rows \(6, 8\) on cpu do not match the input \(5, 8\)"):
        r.check_input(torch.zeros(5, 8), "blocks.0.uvqk")
    with pytest.raises(ValueError, match=r"do not match the input \(6, 4\).*\[6, N\]"):
        r.check_input(torch.zeros(6, 4), "out")
    with pytest.raises(ValueError, match=r"on cpu do not match the input \(6, 8\) on meta"):
        r.check_input(torch.zeros(6, 8, device="meta"), "out")


def test_a_callable_without_the_method_gets_a_plain_call():
    linear = nn.Linear(8, 4)
    x = torch.randn(3, 8)
    assert wanted_quantization(linear, x.device) is None
    assert wanted_quantization(lambda t: t, x.device) is None
    assert not isinstance(linear, PrequantizedInputLinear)
    torch.testing.assert_close(call_linear(linear, x, None), linear(x), rtol=0, atol=0)


def test_a_linear_with_the_method_says_what_it_wants_and_gets_the_rows():
    wants = RowQuantization(column_amax=True)
    linear = Recording(wants)
    assert isinstance(linear, PrequantizedInputLinear)
    assert wanted_quantization(linear, torch.device("cpu")) == wants
    r = rows(5, 8)
    call_linear(linear, torch.zeros(5, 8), r)
    call_linear(linear, torch.zeros(5, 8), None)
    assert linear.calls == [r, None]
    assert wanted_quantization(Recording(None), torch.device("cpu")) is None


def test_a_wrong_answer_names_the_linear():
    with pytest.raises(TypeError, match="Recording.input_quantization returned str; expected RowQuantization or None"):
        wanted_quantization(Recording("e4m3"), torch.device("cpu"))


class FusedSpy(LoopAttention):
    """An attention kernel offering a fused block that records the ``out`` it is handed."""

    def fused_block(self, norm_gate):
        return self._block

    def _block(self, x, uvqk, out, gate_weight, gate_bias, seq_offsets, *, num_heads, value_dim, **options):
        self.out_seen = out
        return x + out(torch.zeros(x.shape[0], num_heads * value_dim, dtype=x.dtype))


@pytest.mark.parametrize(("dropout", "training", "itself"), [(0.0, True, True), (0.5, False, True), (0.5, True, False)])
def test_the_block_hands_over_its_output_linear_itself_unless_dropout_is_active(dropout, training, itself):
    attention = FusedSpy()
    block = HSTUBlock(dim=8, num_heads=2, attention_dim=4, value_dim=2, max_seq_len=8, max_attn_len=0, alpha=1.0,
                      dropout=dropout, attention=attention, norm_gate=TorchNormGate())  # fmt: skip
    block.train(training)
    block(torch.randn(3, 8), torch.tensor([0, 3]), None)
    assert (attention.out_seen is block.out) == itself
