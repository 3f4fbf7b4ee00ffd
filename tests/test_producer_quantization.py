"""Quantization inside the producers (issue 30): the fused HSTU block's layer norm and norm-gate write the
e4m3 rows of their outputs, and fp8_rowwise's linears read them instead of quantizing their inputs.

- The producers' bytes, scales and column maxima (and the norm-gate's rows of its input x, kept by
  fp8_saved) are bit-identical to gem-precision's reference quantizer
  applied to the bf16 (or fp32) output they write, on fresh random data with a row of zeros, rows holding
  an infinity or a NaN, a width that is not a multiple of the tile and rows over several programs.
- The fused block under fp8_rowwise (emulated backend) with producer quantization gives bit for bit the
  output and every gradient of the same block whose linears quantize their inputs themselves: the GEMM
  operands are the same bytes either way, and the interpreter runs the kernels' programs in order, so
  nothing else can differ. (On a GPU the attention's atomic dq, when chosen, can reorder sums between
  any two runs; benchmarks/producer_quantization.py checks the H200 run.)
- In backward (bf16 weight gradient), the gap's last pass writes the e4m3 rows of the ``uvqk`` linear's
  output gradient, bit-identical to the reference's, with its column sums, and the next block's layer
  norm backward those of the ``out`` linear's; the linears take them (``gem_model.api.GradRowsSlot``):
  the same bits again, except those biases' gradients, whose float32 sums run in another order (to 1e-6).
- Linears without the method (bf16) or that decline (fp8_tensorwise) get plain calls.

Triton runs in its interpreter (the root conftest.py sets it on a machine without a GPU).
"""

from __future__ import annotations

import pytest
import torch

from gem_kernels import hstu_block, norm_gate_triton
from gem_kernels.attention import TritonJaggedAttention
from gem_kernels.hstu_block import hstu_block_triton
from gem_kernels.hstu_gap_triton import hstu_gap_triton
from gem_kernels.layer_norm_triton import norm_fork
from gem_kernels.norm_gate import TritonNormGate
from gem_kernels.norm_gate_triton import NormGateFunction
from gem_kernels.quantized_rows_triton import ROWS_PER_PROGRAM_WITH_COLUMNS, RowsOut
from gem_kernels.testing import offsets_from_lengths
from gem_model.api import (
    AttentionExtras,
    GradRowsSlot,
    PrequantizedRows,
    RowQuantization,
    grad_rows_slot,
    wanted_quantization,
)
from gem_model.model.hstu import GATE_EPS, HSTUBlock
from gem_precision.formats import E4M3
from gem_precision.fp8_reference import quantize_fp8_reference
from gem_precision.recipes import Fp8Recipe
from gem_precision.schemes import Bf16Scheme, Fp8RowwiseScheme, Fp8TensorwiseScheme
from gem_precision.testing import mx_edge_cases

pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf, on purpose
ROWS = ROWS_PER_PROGRAM_WITH_COLUMNS + 9  # two programs merge their column maxima, the second one short
WIDTH = 40  # the tile is 64 wide: its last 24 columns are masked


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    return torch.Generator().manual_seed(seed)


def with_special_rows(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    t[3] = 0  # a row of zeros
    t[5, 11] = float("inf")
    t[ROWS - 2, 0] = float("nan")  # in the second program
    return t


def assert_reference_bits(rows: PrequantizedRows, y: torch.Tensor) -> None:
    """``rows`` are quantize_fp8_reference(y, granularity="row", fmt=E4M3) to the bit, and y's column maxima."""
    want = quantize_fp8_reference(y.reshape(-1, y.shape[-1]), granularity="row", fmt=E4M3).rows
    assert want is not None
    assert torch.equal(rows.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(rows.scale_inv.view(torch.int32), want.scale_inv.reshape(-1).view(torch.int32))  # NaN bits too
    amax = (y.reshape(-1, y.shape[-1]).float().view(torch.int32) & 0x7FFFFFFF).amax(0)
    assert torch.equal(rows.column_amax_bits, amax)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_norm_rows_are_the_reference_bits(gen, dtype):
    x = with_special_rows(torch.randn(ROWS, WIDTH, generator=gen) * 4 + 1).to(dtype)
    ln, _, rows = norm_fork(x, quantize=RowQuantization(column_amax=True))
    assert ln[3].eq(0).all() and ln[5].isnan().all()  # the special rows reach the quantizer as such
    assert_reference_bits(rows, ln)


@pytest.fixture(params=[False, True], ids=["byte stores", "word stores"])
def word_stores(request, monkeypatch) -> bool:
    """The norm-gate forward writing its rows as bytes or as 16-bit words (``E4M3_WORD_STORES``)."""
    monkeypatch.setattr(norm_gate_triton, "E4M3_WORD_STORES", request.param)
    return request.param


@pytest.mark.parametrize("silu_gate", [True, False])
def test_norm_gate_rows_are_the_reference_bits(gen, silu_gate, word_stores):
    x = with_special_rows(torch.randn(ROWS, WIDTH, generator=gen)).bfloat16()
    u = (torch.randn(ROWS, WIDTH, generator=gen) * 3).bfloat16()
    u[7] = 0  # a gate of zeros: a row of zeros
    weight, bias = 1 + 0.1 * torch.randn(WIDTH, generator=gen), 0.1 * torch.randn(WIDTH, generator=gen)
    out = RowsOut.allocate(ROWS, WIDTH, x.device, RowQuantization(column_amax=True))
    # and x's own rows, which fp8_saved's fused gap keeps in place of the attention output
    x_rows = RowsOut.allocate(ROWS, WIDTH, x.device, RowQuantization())
    y, _, _ = NormGateFunction.run_forward(x, u, weight, bias, GATE_EPS, silu_gate=silu_gate, rows_out=out,
                                           x_rows=x_rows)  # fmt: skip
    assert_reference_bits(out.result(), y)
    plain = NormGateFunction.run_forward(x, u, weight, bias, GATE_EPS, silu_gate=silu_gate)[0]
    torch.testing.assert_close(y, plain, rtol=0, atol=0, equal_nan=True)  # the rows leave y as it was
    want = quantize_fp8_reference(x, granularity="row", fmt=E4M3).rows
    assert torch.equal(x_rows.data, want.data.view(torch.uint8))
    assert torch.equal(x_rows.scale_inv.view(torch.int32), want.scale_inv.reshape(-1).view(torch.int32))  # NaN bits too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_branch_of_the_rule_gives_the_reference_bits(dtype, word_stores):
    """gem-precision's edge cases (zeros, subnormals, powers of two and just below, amaxes at and above
    1.75 * 2**k, infinities, NaN, huge next to tiny, rounding ties) as the norm-gate's output: with a zero
    weight and a unit bias it writes ``y = u``. Word stores need an even width: 44 columns, else 45."""
    rows = [t for t in mx_edge_cases().values() if t.shape[1] == 64]
    width = 44 if word_stores else 45
    u = torch.cat(rows)[:, :width].to(dtype)  # of the tile's 64 columns
    if dtype == torch.bfloat16:  # the interpreter mishandles bf16 subnormals in registers: float32 has them
        u = torch.where(u.abs() < torch.finfo(dtype).tiny, u * 0, u)
    n = u.shape[0]
    out = RowsOut.allocate(n, width, u.device, RowQuantization(column_amax=True))
    x = torch.randn(n, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    y, _, _ = NormGateFunction.run_forward(x, u, torch.zeros(width), torch.ones(width), GATE_EPS, rows_out=out)
    assert torch.equal(y.view(torch.uint8), u.view(torch.uint8))
    assert_reference_bits(out.result(), y)


def block(scheme) -> HSTUBlock:
    b = HSTUBlock(dim=32, num_heads=2, attention_dim=16, value_dim=16, max_seq_len=16, max_attn_len=0, alpha=0.25,
                  dropout=0.0, attention=TritonJaggedAttention(), norm_gate=TritonNormGate(), position_bias=True)  # fmt: skip
    b.uvqk = scheme.convert_linear(b.uvqk, "blocks.0.uvqk")
    b.out = scheme.convert_linear(b.out, "blocks.0.out")
    return b.to(torch.bfloat16)


def run_blocks(blocks: list[HSTUBlock], x: torch.Tensor, dy: torch.Tensor, *, producers: bool) -> list[torch.Tensor]:
    """Output and gradients of fused blocks in a row; without ``producers`` their linears are handed over
    as plain callables, which have neither ``input_quantization`` nor ``grad_rows_slot``, so they quantize
    their inputs and output gradients themselves."""
    offsets, targets = offsets_from_lengths([6, 0, 11, 3]), torch.tensor([1, 0, 2, 1])
    xi = x.clone().requires_grad_()
    y = xi
    for b in blocks:
        if producers:
            y = b(y, offsets, targets)
        else:
            y = hstu_block_triton(y, lambda t, b=b: b.uvqk(t), lambda t, b=b: b.out(t), b.gate_weight, b.gate_bias,
                                  offsets, num_heads=2, attention_dim=16, value_dim=16, max_seq_len=16, alpha=0.25,
                                  eps=GATE_EPS, extras=AttentionExtras(num_targets=targets, position_bias=b.position_bias))  # fmt: skip
    params = [p for b in blocks for p in b.parameters()]
    return [y, *torch.autograd.grad(y, [xi, *params], dy)]


def random_block_inputs(blocks: list[HSTUBlock], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        for b in blocks:
            for p in b.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5))
    return torch.randn(20, 32, generator=gen).bfloat16(), torch.randn(20, 32, generator=gen).bfloat16()


@pytest.mark.parametrize("weight_gradient", ["bf16", "fp8"])
def test_fused_blocks_with_producer_quantization_are_bit_identical(gen, monkeypatch, weight_gradient):
    """Two blocks in a row. The producers' rows (and, for an fp8 weight gradient, column maxima) give the
    linears' own results. With the bf16 weight gradient the output gradients' rows come from their
    producers too: the gap's for each ``uvqk``, the second block's layer norm backward for the first
    block's ``out`` (through the residual add); the last ``out`` quantizes its own."""
    config = Fp8RowwiseScheme.Config(backend="emulated", producer_quantization=True, weight_gradient=weight_gradient)
    blocks = [block(Fp8RowwiseScheme(config)) for _ in range(2)]
    x, dy = random_block_inputs(blocks, gen)
    assert wanted_quantization(blocks[0].uvqk, x.device) == RowQuantization(column_amax=weight_gradient == "fp8")
    calls: list[str] = []
    for name in ("quantize", "quantize_prequantized"):
        real = getattr(Fp8Recipe, name)
        monkeypatch.setattr(Fp8Recipe, name, lambda self, t, *a, _n=name, _f=real, **kw: calls.append(
            kw.get("role", _n)) or _f(self, t, *a, **kw))  # fmt: skip
    produced = run_blocks(blocks, x, dy, producers=True)
    assert "input" not in calls  # every linear took the forward's rows
    bf16_dw = weight_gradient == "bf16"
    assert calls.count("quantize_prequantized") == (7 if bf16_dw else 4)
    assert calls.count("grad") == (1 if bf16_dw else 4)
    calls.clear()
    themselves = run_blocks(blocks, x, dy, producers=False)
    assert calls.count("input") == 4 and calls.count("grad") == 4 and "quantize_prequantized" not in calls
    names = ["y", "x", *(f"{i}.{n}" for i, b in enumerate(blocks) for n, _ in b.named_parameters())]
    summed_elsewhere = {"0.uvqk.bias", "1.uvqk.bias", "0.out.bias"} if bf16_dw else set()
    for name, got, want in zip(names, produced, themselves, strict=True):
        if name in summed_elsewhere:  # the producers' float32 column sums: another order
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want), f"{name} differs"


@pytest.mark.parametrize("scheme", [Bf16Scheme(), Fp8TensorwiseScheme(Fp8TensorwiseScheme.Config(backend="emulated"))],
                         ids=lambda s: s.name)  # fmt: skip
def test_linears_that_take_no_rows_get_plain_calls(gen, scheme, monkeypatch):
    # out's residual-epilogue GEMM rounds its output once where the add rounds twice (its own test:
    # tests/test_linear_epilogue_block.py); off here, the producer path must give the plain call's bits
    monkeypatch.setattr(hstu_block, "LINEAR_RESIDUAL", False)
    blocks = [block(scheme)]
    x, dy = random_block_inputs(blocks, gen)
    b = blocks[0]
    assert wanted_quantization(b.uvqk, x.device) is None and wanted_quantization(b.out, x.device) is None
    assert grad_rows_slot(b.uvqk, x.device) is None and grad_rows_slot(b.out, x.device) is None
    for got, want in zip(run_blocks(blocks, x, dy, producers=True), run_blocks(blocks, x, dy, producers=False)):
        assert torch.equal(got, want)


def test_the_gaps_gradient_rows_are_the_reference_bits(gen):
    """The rows the gap offers the uvqk linear are the reference's e4m3 rows of the gradient it returns,
    and its column sums that gradient's; a NaN in the last sequence (one row long, so that the
    attention keeps it to that row) makes that row all NaN bytes, as the reference's."""
    heads, dqk, dv = 2, 16, 16
    width = heads * (2 * dv + 2 * dqk)
    offsets = offsets_from_lengths([7, 0, 11, 1])
    pre = (torch.randn(19, width, generator=gen) * 2).bfloat16().requires_grad_()
    weight, bias = 1 + 0.1 * torch.randn(heads * dv, generator=gen), 0.1 * torch.randn(heads * dv, generator=gen)
    dy = torch.randn(19, heads * dv, generator=gen).bfloat16()
    dy[18, 3] = float("nan")
    slot = GradRowsSlot(column_sum=True)
    y, _ = hstu_gap_triton(pre, weight, bias, offsets, num_heads=heads, attention_dim=dqk, value_dim=dv, max_seq_len=16,
                           alpha=0.25, eps=GATE_EPS, dq_mode="atomic", grad_rows=slot)  # fmt: skip
    (d_pre,) = torch.autograd.grad(y, pre, dy)
    offered = slot.take(d_pre)
    assert offered is not None
    assert d_pre[:18].float().isfinite().all() and d_pre[18].float().isnan().any()
    want = quantize_fp8_reference(d_pre, granularity="row", fmt=E4M3).rows
    assert torch.equal(offered.rows.data.view(torch.uint8), want.data.view(torch.uint8))
    assert torch.equal(offered.rows.scale_inv.view(torch.int32), want.scale_inv.reshape(-1).view(torch.int32))
    finite_cols = d_pre[18].float().isfinite()
    torch.testing.assert_close(offered.column_sum[finite_cols], d_pre.double().sum(0)[finite_cols].float(),
                               rtol=1e-6, atol=1e-5)  # fmt: skip
    assert offered.column_sum[~finite_cols].isnan().all()
