"""A linear whose forward GEMM a kernel plugin supplies, so that the GEMM's epilogue can do more.

The precision scheme keeps what it owns: the master weights, their casts, the backward and the
gradients' dtypes. A fused block hands it a :data:`LinearGemm`, a callable with ``F.linear``'s
contract on 2-D operands in the GEMM's dtype (``gemm(x, weight, bias) -> y``), which the linear then
calls in place of its own forward GEMM. What else that callable writes (gem-kernels' uvqk projection
writes the silu of three quarters of its output beside it) is the block's business; the linear's
backward is unchanged, as it sees only ``y``.

    if takes_gemm(uvqk, x):
        pre = call_linear(uvqk, x, None, gemm=my_gemm)

A linear offers this by a ``takes_gemm(x) -> bool`` method (asked before each call: the answer may
depend on the input's device and on ``torch.compile``) and a ``gemm=`` keyword on its call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

LinearGemm = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
"""``gemm(x [M, K], weight [N, K], bias [N] or None) -> [M, N]``: ``F.linear``'s result, in ``x``'s dtype."""


@runtime_checkable
class GemmTakingLinear(Protocol):
    """A linear that runs a supplied forward GEMM (gem-precision's ``bf16`` scheme's linear)."""

    def takes_gemm(self, x: torch.Tensor) -> bool:
        """Whether a call on ``x`` would run a supplied GEMM."""
        ...

    def __call__(self, x: torch.Tensor, *, gemm: LinearGemm | None = None) -> torch.Tensor: ...


def takes_gemm(linear: Callable[..., Any], x: torch.Tensor) -> bool:
    """Whether ``linear`` runs a supplied GEMM on ``x``; False for a callable without the method."""
    ask = getattr(linear, "takes_gemm", None)
    if ask is None:
        return False
    answer = ask(x)
    if not isinstance(answer, bool):
        raise TypeError(f"{type(linear).__name__}.takes_gemm returned {type(answer).__name__}; expected bool")
    return answer
