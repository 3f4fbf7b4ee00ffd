"""Linears that take their input pre-quantized: the contract between the kernel that produces a GEMM's
input and the linear that consumes it.

An fp8 linear quantizes its input itself: one pass reads ``x`` for its row (and column) maxima, a
second writes the fp8 operands. When ``x`` comes out of a kernel that holds each row whole (a layer
norm, a norm-gate), that kernel can write the fp8 rows and their scales in the same pass, and the
linear skips its own row quantization (and, given the column maxima too, its statistics pass).

The two sides meet through duck typing, so neither names the other's package:

- the linear says what it wants, ``linear.input_quantization(device) -> RowQuantization | None``
  (None: it quantizes nothing of its input, or quantizes it another way);
- the producer writes that, and the caller passes it on: ``linear(x, prequantized=rows)`` with
  ``rows`` a :class:`PrequantizedRows` of exactly ``x``'s values. The call goes through the module's
  ``__call__``, so hooks (FSDP2's all-gather, say) run as for a plain call.

:func:`wanted_quantization` and :func:`call_linear` are the producer side's whole use of it: a callable
without ``input_quantization`` (``nn.Linear``, a lambda) gets no rows and a plain call.

The quantization (:class:`RowQuantization`'s constants, the rowwise rule of gem-precision's
``fp8_reference``): e4m3 (``torch.float8_e4m3fn``, largest value 448 = 1.75 * 2**8), one power-of-two
scale per row. A row with ``amax = max |x|`` gets ``2**s``, ``s`` the largest integer with
``amax * 2**s <= 448``, clamped to [-126, 126]; from the float32 bits of ``amax``,
``s = 8 - (exponent field - 127) - (1 if fraction field > 0x600000 else 0)``. The bytes are
``x * 2**s`` rounded to nearest even (no value saturates), ``scale_inv = 2**-s`` (float32). A row that
holds a NaN or an infinity has every byte 0x7F and ``scale_inv`` NaN with bits 0x7FC00000, so its
GEMM output is NaN and the run's non-finite check stops it. The column maxima are ``|x|`` as int32
bit patterns (non-negative floats order as their bits; a NaN sorts above infinity), maximised over
the rows of each column.

Forward only. The backward's gradients cannot ride this contract: autograd hands one plain tensor from
a function's backward to the next, so the kernel that writes a gradient whole per row has no way to
hand its quantized rows to the linear's backward, nor to know that the gradient it wrote is all the
linear will get (autograd sums the gradients of every use of a tensor). They travel through a slot
set up in the forward instead: :mod:`gem_model.grad_rows`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class RowQuantization:
    """What a linear wants of its input ``x [M, N]`` (leading dims flattened into ``M``): the e4m3 rows
    and their scales by the rule in the module docstring, and with ``column_amax`` the maxima of ``|x|``
    over each column (a transposed operand's scales, for the weight gradient, need them).

    The class constants are the rule, for kernels that write it (they cannot import gem-precision,
    whose ``fp8_reference`` is the same rule in torch).
    """

    column_amax: bool = False

    DTYPE: ClassVar[torch.dtype] = torch.float8_e4m3fn
    MAX: ClassVar[float] = 448.0
    EMAX: ClassVar[int] = 8
    """Exponent of :attr:`MAX` (1.75 * 2**8)."""
    MAX_FRACTION_BITS: ClassVar[int] = 0x600000
    """The float32 fraction field of 1.75: an amax whose fraction is above it costs one more bit."""
    MANTISSA_BITS: ClassVar[int] = 3
    MIN_NORMAL: ClassVar[float] = 2.0**-6
    SCALE_EXPONENT_LIMIT: ClassVar[int] = 126
    """``|s| <= 126`` keeps both ``2**s`` and ``2**-s`` normal float32 numbers."""
    NAN_BYTE: ClassVar[int] = 0x7F
    NAN_SCALE_BITS: ClassVar[int] = 0x7FC00000


@dataclass(frozen=True)
class PrequantizedRows:
    """A linear's input ``x [M, N]`` already quantized as :class:`RowQuantization` says.

    ``data``: ``float8_e4m3fn [M, N]`` with contiguous rows; ``scale_inv``: float32 ``[M]``, the
    dequantization factors (``x[i] ~= data[i] * scale_inv[i]``); ``column_amax_bits``: int32 ``[N]``
    or None. Checked when made; :meth:`check_input` checks it against the ``x`` it stands for.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    column_amax_bits: torch.Tensor | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.data.dtype != RowQuantization.DTYPE or self.data.dim() != 2 or self.data.stride(-1) != 1:
            problems.append(
                f"data must be {RowQuantization.DTYPE} [M, N] with contiguous rows, got {self.data.dtype} "
                f"{tuple(self.data.shape)} strides {self.data.stride()}"
            )
        rows = self.data.shape[0] if self.data.dim() else None
        if self.scale_inv.dtype != torch.float32 or self.scale_inv.shape != (rows,):
            problems.append(
                f"scale_inv must be float32 [{rows}], got {self.scale_inv.dtype} {tuple(self.scale_inv.shape)}"
            )
        amax = self.column_amax_bits
        cols = self.data.shape[-1] if self.data.dim() else None
        if amax is not None and (amax.dtype != torch.int32 or amax.shape != (cols,)):
            problems.append(f"column_amax_bits must be int32 [{cols}], got {amax.dtype} {tuple(amax.shape)}")
        others = [t.device for t in (self.scale_inv, amax) if t is not None and t.device != self.data.device]
        if others:
            problems.append(f"every part must be on data's device {self.data.device}, found {others[0]}")
        if problems:
            raise ValueError("PrequantizedRows: " + "; ".join(problems))

    def check_input(self, x: torch.Tensor, where: str) -> None:
        """Raise unless these rows can stand for ``x`` (``[..., N]``, on the same device); ``where``
        names the linear in the message."""
        rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
        if x.dim() == 0 or tuple(self.data.shape) != (rows, x.shape[-1]) or x.device != self.data.device:
            raise ValueError(
                f"{where}: pre-quantized rows {tuple(self.data.shape)} on {self.data.device} do not match the "
                f"input {tuple(x.shape)} on {x.device} (they must be its [{rows}, N] rows)"
            )


@runtime_checkable
class PrequantizedInputLinear(Protocol):
    """A linear that may take its input pre-quantized (gem-precision's fp8 rowwise ``ScaledLinear``)."""

    def input_quantization(self, device: torch.device) -> RowQuantization | None:
        """What it wants of an input on ``device``, or None when it takes no pre-quantized rows there
        (asked before each call: the answer may depend on the device, and on whether grad is enabled)."""
        ...

    def __call__(self, x: torch.Tensor, *, prequantized: PrequantizedRows | None = None) -> torch.Tensor: ...


def wanted_quantization(linear: Callable[..., Any], device: torch.device) -> RowQuantization | None:
    """What ``linear`` wants its input on ``device`` quantized as; None for a callable without the method."""
    ask = getattr(linear, "input_quantization", None)
    if ask is None:
        return None
    wanted = ask(device)
    if wanted is not None and not isinstance(wanted, RowQuantization):
        raise TypeError(
            f"{type(linear).__name__}.input_quantization returned {type(wanted).__name__}; expected "
            "RowQuantization or None"
        )
    return wanted


def call_linear(
    linear: Callable[..., torch.Tensor], x: torch.Tensor, rows: PrequantizedRows | None, grad_rows: Any = None,
    gemm: Any = None,
) -> torch.Tensor:
    """``linear(x)``, handing it ``rows`` (``x`` quantized as it asked) when there are some, ``grad_rows``
    (the :class:`gem_model.grad_rows.GradRowsSlot` it made) and ``gemm`` (a
    :data:`gem_model.linear_gemm.LinearGemm`, for a linear that :func:`~gem_model.linear_gemm.takes_gemm`)
    when given."""
    kwargs: dict[str, Any] = {}
    if rows is not None:
        kwargs["prequantized"] = rows
    if grad_rows is not None:
        kwargs["grad_rows"] = grad_rows
    if gemm is not None:
        kwargs["gemm"] = gemm
    return linear(x, **kwargs)
