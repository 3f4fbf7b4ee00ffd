"""fp8_rowwise's weight gradient from the unquantized ``g`` and the saved ``x``: option ``weight_gradient:
bf16`` (torchao's ``rowwise_with_gw_hp``) and ``fp8_blocks`` (an e4m3 GEMM with 1 x 128 block scales,
:mod:`gem_precision.blockwise_weight_grad`), on CPU through the emulated backend (the same recipe code as
native, with the torch reference quantization; the native GEMMs need CUDA).

What is asserted, on fresh random data: under ``bf16``, ``dW`` equals the bf16 reference
``g.bf16().T @ x.bf16()`` (the same torch.mm on the same bf16 operands: bitwise); ``y``, ``dx`` and the
bias gradient are bitwise those of ``weight_gradient: fp8``; the forward saves ``x`` (bf16, as given) and
no fp8 transposed operand of it; no transposed operand of ``x`` or ``g`` is ever quantized by the recipe;
a producer is asked for rows only, and its rows give the same results. Under ``fp8_blocks``, ``y``,
``dx`` and the bias gradient are bitwise ``bf16``'s, the forward and the producers are as under ``bf16``,
and ``dW`` is the block-scaled GEMM of operands made in backward: the float32 product of the reference's
dequantized operands, within e4m3's rounding of the float64 ``g^T x``; the Triton quantizer (under
TRITON_INTERPRET=1) makes the reference's bits.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from gem_model.api import GradRowsSlot, RowQuantization
from gem_precision import blockwise_weight_grad, gemm_rates
from gem_precision.blockwise_weight_grad import block_scaled_mm, block_scaled_operands, block_scaled_weight_grad
from gem_precision.formats import E4M3
from gem_precision.fp8_reference import Fp8Operand, quantize_blocks_t_reference
from gem_precision.recipes import Fp8Recipe
from gem_precision.schemes import Fp8RowwiseScheme, Fp8TensorwiseScheme, MXFP8Scheme
from gem_precision.testing import producer_rows, raw_bytes, rel_err

CPU = torch.device("cpu")
IN, OUT, BATCH, TOKENS = 96, 48, 2, 25  # 50 rows: x's transposed operand [96, 50] is unlike W's [96, 48]
BLOCK_TOKENS = 150  # 300 rows for fp8_blocks: blocks of 128, 128 and 44 tokens (84 of padding)
DW_BLOCKS_TOLERANCE = 0.05
"""fp8_blocks' dW against the float64 ``g^T x`` (Frobenius, relative), normal bf16 data, 300 tokens, 96 -> 48:
measured 0.036-0.039 (median 0.0376) over 200 seeds, each product's e4m3 rounding of both operands
(the bf16 GEMM's is 0.0016-0.0017); 0.05 leaves a quarter of margin, while a misread scale is off by
order 1."""
Grads = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
Saved = list[tuple[tuple[int, ...], torch.dtype]]


def rowwise(weight_gradient: str, **options: Any) -> Fp8RowwiseScheme:
    return Fp8RowwiseScheme(Fp8RowwiseScheme.Config(backend="emulated", weight_gradient=weight_gradient, **options))


def converted(linear: nn.Linear, weight_gradient: str, **options: Any) -> nn.Module:
    return rowwise(weight_gradient, **options).convert_linear(copy.deepcopy(linear), "blocks.0.out")


def problem(gen: torch.Generator, tokens: int = TOKENS) -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    """A linear with random weights, and a bf16 input and output gradient (never zeros), ``BATCH x tokens``."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    linear = nn.Linear(IN, OUT)
    x = torch.randn(BATCH, tokens, IN, generator=gen).bfloat16()
    gy = torch.randn(BATCH, tokens, OUT, generator=gen).bfloat16()
    assert x.count_nonzero() == x.numel() and gy.count_nonzero() == gy.numel()
    return linear, x, gy


def run(module: nn.Module, x: torch.Tensor, gy: torch.Tensor, *, x_grad: bool = True, **kwargs: Any) -> Grads:
    """``y`` and the gradients of ``x``, the weight and the bias (None where none is asked)."""
    xi = x.detach().clone().requires_grad_(x_grad)
    y = module(xi, **kwargs)
    y.backward(gy)
    return y.detach(), xi.grad, module.weight.grad, module.bias.grad


def bf16_weight_grad(x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """The reference: what the bf16 scheme computes for ``dW`` (bf16 GEMM), in float32 master dtype."""
    return (gy.reshape(-1, OUT).bfloat16().t() @ x.reshape(-1, IN).bfloat16()).float()


@contextmanager
def quantize_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[tuple[int, ...], bool]]]:
    """Every quantization the fp8 recipe runs: (shape of the tensor, whether a transposed operand is made)."""
    calls: list[tuple[tuple[int, ...], bool]] = []
    real = Fp8Recipe._quantize

    def counting(self: Fp8Recipe, t: torch.Tensor, **kwargs: Any) -> Any:
        calls.append((tuple(t.shape), kwargs["cols_t"]))
        return real(self, t, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(Fp8Recipe, "_quantize", counting)
        yield calls


def forward_saving(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, Saved]:
    """``module(x)``, and the shape and dtype of every tensor its forward saved for backward."""
    saved: Saved = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        return module(x), saved


def test_config_field_validates() -> None:
    assert Fp8RowwiseScheme().config.weight_gradient == "bf16"  # the default since it measured faster
    assert Fp8RowwiseScheme().recipe_for(CPU).high_precision_weight_grad
    assert rowwise("bf16").recipe_for(CPU).high_precision_weight_grad
    assert not rowwise("fp8").recipe_for(CPU).high_precision_weight_grad
    # fp8_blocks: dW from the unquantized g and the saved x too (the forward as bf16's), in block-scaled e4m3
    blocks = rowwise("fp8_blocks").recipe_for(CPU)
    assert blocks.high_precision_weight_grad and blocks.block_scaled_weight_grad
    assert not rowwise("bf16").recipe_for(CPU).block_scaled_weight_grad
    assert not rowwise("fp8").recipe_for(CPU).block_scaled_weight_grad
    with pytest.raises(ValueError, match="needs high_precision_weight_grad"):
        Fp8Recipe("fp8_rowwise", granularity="row", grad_format=E4M3, native=False, fast_accum_forward=False,
                  block_scaled_weight_grad=True)  # fmt: skip
    with pytest.raises(ValidationError, match=r"weight_gradient\n.*'fp8', 'bf16' or 'fp8_blocks'"):
        Fp8RowwiseScheme.Config(weight_gradient="fp16")
    with pytest.raises(ValidationError, match=r"weight_grad\n.*Extra inputs are not permitted"):
        Fp8RowwiseScheme.Config(weight_grad="bf16")
    # fp8_tensorwise has no such option, and its recipe (like MXFP8's) never computes dW in high precision
    with pytest.raises(ValidationError, match=r"weight_gradient\n.*Extra inputs are not permitted"):
        Fp8TensorwiseScheme.Config(weight_gradient="bf16")
    assert not Fp8TensorwiseScheme().recipe_for(CPU).high_precision_weight_grad
    assert not MXFP8Scheme(MXFP8Scheme.Config(backend="emulated")).recipe_for(CPU).high_precision_weight_grad
    assert not Fp8TensorwiseScheme().recipe_for(CPU).block_scaled_weight_grad
    assert not MXFP8Scheme(MXFP8Scheme.Config(backend="emulated")).recipe_for(CPU).block_scaled_weight_grad


def test_bf16_weight_gradient_is_the_bf16_gemm_and_y_dx_are_unchanged(gen: torch.Generator) -> None:
    linear, x, gy = problem(gen)
    fp8 = run(converted(linear, "fp8"), x, gy)
    hp = run(converted(linear, "bf16"), x, gy)
    assert hp[0].dtype == torch.bfloat16 and hp[2] is not None and hp[2].dtype == torch.float32
    for name, got, want in zip(("y", "dx", "db"), (hp[0], hp[1], hp[3]), (fp8[0], fp8[1], fp8[3])):
        assert torch.equal(got, want), name  # the same quantized operands and GEMMs: bitwise
    torch.testing.assert_close(hp[2], bf16_weight_grad(x, gy), rtol=0, atol=0)  # the same bf16 torch.mm
    # and it is not the fp8 GEMM: closer to the float64 product (~1.7e-3) than fp8's (~3.7e-2)
    exact = gy.reshape(-1, OUT).double().t() @ x.reshape(-1, IN).double()
    assert rel_err(hp[2], exact) < 1e-2 < rel_err(fp8[2], exact)


def test_forward_saves_x_as_given_and_no_transposed_operand_of_it(gen: torch.Generator, monkeypatch) -> None:
    linear, x, gy = problem(gen)
    x_t_shape, x2d_shape = (IN, BATCH * TOKENS), (BATCH * TOKENS, IN)
    blocks_made: list[tuple[str, tuple[int, ...]]] = []  # fp8_blocks' dW operands (not the recipe's quantize)
    real_blocks = blockwise_weight_grad.quantize_blocks_t_reference
    monkeypatch.setattr(blockwise_weight_grad, "quantize_blocks_t_reference",
                        lambda t, *a, **kw: blocks_made.append((phase, tuple(t.shape))) or real_blocks(t, *a, **kw))
    for weight_gradient in ("fp8", "bf16", "fp8_blocks"):
        blocks_made.clear()
        phase = "forward"
        with quantize_calls(monkeypatch) as calls:
            y, saved = forward_saving(converted(linear, weight_gradient), x.clone().requires_grad_())
        phase = "backward"
        with quantize_calls(monkeypatch) as backward_calls:
            y.backward(gy)
        made_t = {shape for shape, cols_t in calls + backward_calls if cols_t}
        # the forward of fp8_blocks is bf16's; its dW operands are made in backward, from g and the saved x
        want_blocks = [("backward", (BATCH * TOKENS, OUT)), ("backward", x2d_shape)]
        assert blocks_made == (want_blocks if weight_gradient == "fp8_blocks" else [])
        if weight_gradient == "fp8":  # the check sees what it looks for
            assert (x_t_shape, torch.float8_e4m3fn) in saved and (x2d_shape, torch.bfloat16) not in saved
            assert made_t == {(OUT, IN), x2d_shape, (BATCH * TOKENS, OUT)}  # W, x and g
        else:
            assert (x2d_shape, torch.bfloat16) in saved
            assert not any(shape == x_t_shape for shape, _ in saved)
            assert (IN, OUT) in [shape for shape, dtype in saved if dtype == torch.float8_e4m3fn]  # W.T, for dx
            assert made_t == {(OUT, IN)}  # only the weight's transposed operand, for dx


@pytest.mark.parametrize(
    ("x_grad", "w_grad"), [(True, True), (False, True), (False, False)], ids=["dx_dw_db", "dw_db", "db_only"]
)
def test_bias_gradient_with_and_without_dx(gen: torch.Generator, x_grad: bool, w_grad: bool) -> None:
    """Without dx (an input that takes no gradient) the gradient is quantized for nothing but the bias
    sum; with neither dx nor dW the quantizer is asked for the column sums alone."""
    linear, x, gy = problem(gen)
    linear.weight.requires_grad_(w_grad)
    fp8 = run(converted(linear, "fp8"), x, gy, x_grad=x_grad)
    hp = run(converted(linear, "bf16"), x, gy, x_grad=x_grad)
    assert hp[3] is not None and torch.equal(hp[3], fp8[3])
    torch.testing.assert_close(hp[3], gy.reshape(-1, OUT).float().sum(0), rtol=1e-6, atol=1e-6)
    assert (hp[1] is not None) == x_grad and (hp[2] is not None) == w_grad
    if x_grad:
        assert torch.equal(hp[1], fp8[1])
    if w_grad:
        torch.testing.assert_close(hp[2], bf16_weight_grad(x, gy), rtol=0, atol=0)


@pytest.mark.parametrize("native", [False, True], ids=["reference", "triton"])
def test_column_sums_alone(gen: torch.Generator, native: bool) -> None:
    """What backward asks of the gradient with neither dx nor a quantized dW: both quantizers (the
    Triton one under TRITON_INTERPRET=1) return the float32 column sums and nothing else."""
    recipe = Fp8Recipe("fp8_rowwise", granularity="row", grad_format=E4M3, native=native, fast_accum_forward=False,
                       high_precision_weight_grad=True)  # fmt: skip
    g = torch.randn(37, 40, generator=gen).bfloat16()
    q = recipe.quantize(g, role="grad", rows=False, cols_t=False, col_sum=True)
    assert q.rows is None and q.cols_t is None and q.col_sum is not None and q.col_sum.dtype == torch.float32
    torch.testing.assert_close(q.col_sum, g.float().sum(0), rtol=1e-6, atol=1e-6)


def test_producer_is_asked_for_rows_without_column_maxima() -> None:
    linear = nn.Linear(32, 16)
    hp = converted(linear, "bf16", producer_quantization=True)
    assert hp.input_quantization(CPU) == RowQuantization(column_amax=False)
    blocks = converted(linear, "fp8_blocks", producer_quantization=True)
    assert blocks.input_quantization(CPU) == RowQuantization(column_amax=False)
    slot = blocks.grad_rows_slot(CPU)  # g's rows taken from its producer, as under bf16
    assert isinstance(slot, GradRowsSlot) and slot.rows and slot.column_sum
    assert converted(linear, "fp8", producer_quantization=True).input_quantization(CPU) == RowQuantization(
        column_amax=True
    )
    # rows only when producer_quantization asks (its default)
    assert converted(linear, "bf16", producer_quantization=False).input_quantization(CPU) is None
    assert converted(linear, "bf16").input_quantization(CPU) == RowQuantization(column_amax=False)


@pytest.mark.parametrize("weight_gradient", ["bf16", "fp8_blocks"])
@pytest.mark.parametrize("column_amax", [False, True], ids=["rows", "rows_and_unused_maxima"])
def test_prequantized_rows_give_the_same_results(gen: torch.Generator, monkeypatch, column_amax: bool,
                                                 weight_gradient: str) -> None:  # fmt: skip
    linear, x, gy = problem(gen)
    module = converted(linear, weight_gradient, producer_quantization=True)
    want = run(module, x, gy)
    module.weight.grad = module.bias.grad = None
    with quantize_calls(monkeypatch) as calls:
        got = run(module, x, gy, prequantized=producer_rows(x, column_amax=column_amax))
    assert calls and all(shape != (BATCH * TOKENS, IN) for shape, _ in calls)  # x: neither rows nor cols_t
    for name, a, b in zip(("y", "dx", "dw", "db"), got, want):
        assert torch.equal(a, b), name
    if weight_gradient == "bf16":
        torch.testing.assert_close(got[2], bf16_weight_grad(x, gy), rtol=0, atol=0)


def test_rates_time_the_bf16_weight_gradient_gemm(gen: torch.Generator, monkeypatch) -> None:
    roles: list[str] = []
    real = Fp8Recipe.mm
    monkeypatch.setattr(Fp8Recipe, "mm", lambda self, a, b, **kw: roles.append(kw["role"]) or real(self, a, b, **kw))
    linear, x, gy = problem(gen)
    seconds = gemm_rates._gemm_seconds(rowwise("bf16"), linear, x.reshape(-1, IN), gy.reshape(-1, OUT), CPU)
    assert seconds is not None and seconds > 0
    assert roles and "grad_weight" not in roles and {"forward", "grad_input"} <= set(roles)


def test_rates_time_the_block_scaled_weight_gradient_gemm(gen: torch.Generator, monkeypatch) -> None:
    """fp8_blocks' GEMMs alone: the recipe's forward and dx GEMMs and the block-scaled dW GEMM, whose
    operands (like every other quantization) are made before the timed GEMMs."""
    roles: list[str] = []
    real_mm, real_blocks = Fp8Recipe.mm, gemm_rates.block_scaled_mm
    monkeypatch.setattr(Fp8Recipe, "mm", lambda self, a, b, **kw: roles.append(kw["role"]) or real_mm(self, a, b, **kw))
    monkeypatch.setattr(gemm_rates, "block_scaled_mm",
                        lambda gq, xq, **kw: roles.append("blocks") or real_blocks(gq, xq, **kw))  # fmt: skip
    linear, x, gy = problem(gen)
    seconds = gemm_rates._gemm_seconds(rowwise("fp8_blocks"), linear, x.reshape(-1, IN), gy.reshape(-1, OUT), CPU)
    assert seconds is not None and seconds > 0
    assert "grad_weight" not in roles and {"forward", "grad_input", "blocks"} <= set(roles)


def block_problem(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``g [300, OUT]`` and ``x [300, IN]`` in bf16: three blocks of tokens, the last one padded."""
    return (torch.randn(2 * BLOCK_TOKENS, OUT, generator=gen).bfloat16(),
            torch.randn(2 * BLOCK_TOKENS, IN, generator=gen).bfloat16())  # fmt: skip


def dequantized64(op: Fp8Operand) -> torch.Tensor:
    """``[features, T_pad]`` float64: each byte times its feature's factor for its block of 128 tokens."""
    return op.data.double() * op.scale_inv.double().repeat_interleave(128, dim=1)


def test_fp8_blocks_keeps_bf16s_y_dx_db_and_quantizes_dw_in_blocks(gen: torch.Generator) -> None:
    """The same forward and dx GEMMs as ``bf16`` (bitwise), the same bias gradient; ``dW`` is the
    block-scaled GEMM of ``g`` and ``x`` (bitwise :func:`block_scaled_weight_grad`'s), within e4m3's
    rounding of the float64 product and, being quantized, not ``bf16``'s."""
    linear, x, gy = problem(gen, tokens=BLOCK_TOKENS)
    hp = run(converted(linear, "bf16"), x, gy)
    blocks = run(converted(linear, "fp8_blocks"), x, gy)
    for name, got, want in zip(("y", "dx", "db"), (blocks[0], blocks[1], blocks[3]), (hp[0], hp[1], hp[3])):
        assert torch.equal(got, want), name
    dw = blocks[2]
    assert dw is not None and dw.dtype == torch.float32 and dw.shape == (OUT, IN)
    g2d, x2d = gy.reshape(-1, OUT), x.reshape(-1, IN)
    assert torch.equal(dw, block_scaled_weight_grad(g2d, x2d, native=False))
    exact = g2d.double().t() @ x2d.double()
    assert rel_err(hp[2], exact) < 1e-2 < rel_err(dw, exact) < DW_BLOCKS_TOLERANCE
    assert not torch.equal(dw, hp[2])


def test_fp8_blocks_takes_the_offered_gradient_rows(gen: torch.Generator, monkeypatch) -> None:
    """Offered ``g``'s rows by the kernel that wrote ``g`` (as under ``bf16``), backward quantizes nothing
    by the recipe (dx and the bias from the offer), makes dW's block operands from ``g`` itself, and gives
    bitwise the results of quantizing ``g`` itself."""

    class Producer(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, y: torch.Tensor, slot: GradRowsSlot) -> torch.Tensor:  # type: ignore[override]
            ctx.slot = slot
            return y.clone()

        @staticmethod
        def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
            written = g.clone()
            ctx.slot.offer(written, producer_rows(written, column_amax=False), written.float().sum(0))
            return written, None

    linear, x, gy = problem(gen, tokens=BLOCK_TOKENS)
    x, gy = x.reshape(-1, IN), gy.reshape(-1, OUT)
    module = converted(linear, "fp8_blocks", producer_quantization=True)
    own = run(copy.deepcopy(module), x, gy)
    offered = copy.deepcopy(module)
    roles: list[str] = []
    real = Fp8Recipe.quantize
    monkeypatch.setattr(Fp8Recipe, "quantize", lambda self, t, **kw: roles.append(kw["role"]) or real(self, t, **kw))
    xi = x.clone().requires_grad_()
    slot = offered.grad_rows_slot(CPU)
    Producer.apply(offered(xi, grad_rows=slot), slot).backward(gy)
    assert "grad" not in roles
    for name, got, want in zip(("dx", "dw", "db"), (xi.grad, offered.weight.grad, offered.bias.grad), own[1:]):
        assert torch.equal(got, want), name


def test_emulated_block_gemm_is_the_float32_product_of_the_dequantized_operands(gen: torch.Generator) -> None:
    g, x = block_problem(gen)
    gq, xq = block_scaled_operands(g, x, native=False)
    for op, t in ((gq, g), (xq, x)):  # the reference's layout: [features, T_pad], scales [features, T_pad / 128]
        want = quantize_blocks_t_reference(t, E4M3)
        assert op.data.shape == (t.shape[1], 384) and op.scale_inv.shape == (t.shape[1], 3)
        assert op.scale_inv.stride() == (1, t.shape[1]) and op.data.dtype == torch.float8_e4m3fn
        assert torch.equal(raw_bytes(op.data), raw_bytes(want.data)) and torch.equal(op.scale_inv, want.scale_inv)
        assert not raw_bytes(op.data)[:, 300:].any()  # padding tokens are zeros
    g64, x64 = dequantized64(gq), dequantized64(xq)
    got = block_scaled_weight_grad(g, x, native=False)
    assert got.dtype == torch.float32 and got.shape == (OUT, IN)
    # the dequantized values are exact in float32, so this is the same float32 matmul on the same numbers
    assert torch.equal(got, g64.float() @ x64.float().t())
    assert rel_err(got, g64 @ x64.t()) < 1e-6  # float32 accumulation of 300 products


def test_triton_block_operands_are_the_references_bits(gen: torch.Generator) -> None:
    """The native backend's operands (the one-pass Triton kernel, here under TRITON_INTERPRET=1) are the
    emulated backend's, bit for bit, layouts and strides included."""
    g, x = block_problem(gen)
    for native_op, reference_op in zip(block_scaled_operands(g, x, native=True),
                                       block_scaled_operands(g, x, native=False)):  # fmt: skip
        assert native_op.data.shape == reference_op.data.shape
        assert native_op.scale_inv.shape == reference_op.scale_inv.shape
        assert native_op.scale_inv.stride() == reference_op.scale_inv.stride()
        assert torch.equal(raw_bytes(native_op.data), raw_bytes(reference_op.data))
        assert torch.equal(native_op.scale_inv.view(torch.int32), reference_op.scale_inv.view(torch.int32))


def test_native_block_gemm_passes_the_layout_checked_on_hopper(gen: torch.Generator, monkeypatch) -> None:
    """``torch._scaled_mm`` with 1 x 128 scales cannot run on a CPU; a stand-in that computes what cuBLAS's
    BlockWise1x128 GEMM computes, from the layout ``benchmarks/weight_grad_blockwise.py`` checked on an
    H100/H200 (form ``torch._scaled_mm/rows/float32``), gives the emulated result."""
    seen: list[dict[str, Any]] = []

    def scaled_mm(a, b, scale_a, scale_b, *, out_dtype):  # a [M, K] rows, b [K, N] columns
        seen.append({"b_stride": b.stride(), "sa": (scale_a.shape, scale_a.stride()),
                     "sb": (scale_b.shape, scale_b.stride()), "out_dtype": out_dtype})  # fmt: skip
        a64 = a.double() * scale_a.double().repeat_interleave(128, dim=1)
        b64 = b.double() * scale_b.double().repeat_interleave(128, dim=0)
        return (a64 @ b64).to(out_dtype)

    monkeypatch.setattr(blockwise_weight_grad.torch, "_scaled_mm", scaled_mm)
    g, x = block_problem(gen)
    gq, xq = block_scaled_operands(g, x, native=False)
    got = block_scaled_mm(gq, xq, native=True)
    assert seen == [{"b_stride": (1, 384), "sa": ((OUT, 3), (1, OUT)), "sb": ((3, IN), (IN, 1)),
                     "out_dtype": torch.float32}]  # fmt: skip
    torch.testing.assert_close(got, block_scaled_mm(gq, xq, native=False), rtol=1e-6, atol=1e-5)
