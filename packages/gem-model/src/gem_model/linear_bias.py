"""A linear whose bias gradient another kernel sums: :func:`bias_grad_elsewhere` (and :func:`lent_from`).

A linear's bias gradient is the column sum of its output's gradient, one more pass over that gradient
after whatever wrote it. When the kernels that write the gradient can sum its columns as they go (the
fused HSTU gap of gem-kernels does, for its ``uvqk`` projection), the caller lends them the bias and
calls the linear with the bias detached: the forward is unchanged (the GEMM adds the same values), the
linear's backward no longer sums, and the bias gets its gradient through the caller's own autograd
function instead.

Any linear module that reads ``self.bias`` in its forward fits: ``torch.nn.Linear`` and the precision
schemes' modules. The bias must be a plain ``Parameter`` (not a DTensor: under tensor parallelism the
gradient would have to be a DTensor too) that requires grad; otherwise nothing is lent.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def bias_grad_elsewhere(linear: object) -> Iterator[torch.nn.Parameter | None]:
    """Within the block, ``linear.bias`` is a detached alias of the bias (same storage, no gradient), and
    the bias itself is yielded, for the caller to route its gradient; None (and the linear untouched)
    when the linear has no bias of its own that takes a gradient."""
    params = getattr(linear, "_parameters", None)
    bias = params.get("bias") if isinstance(params, dict) else None
    if type(bias) is not torch.nn.Parameter or not bias.requires_grad or not torch.is_grad_enabled():
        yield None
        return
    alias = torch.nn.Parameter(bias.detach(), requires_grad=False)
    alias._lent_from = bias  # type: ignore[attr-defined]  # lent_from's answer
    params["bias"] = alias
    try:
        yield bias
    finally:
        params["bias"] = bias


def lent_from(t: torch.Tensor) -> torch.Tensor:
    """The parameter that ``t`` stands for: the bias itself when ``t`` is the detached alias
    :func:`bias_grad_elsewhere` put in its place (same storage, so always the same value), else ``t``.
    For code keyed by the parameter object, such as a cache of its casts."""
    return getattr(t, "_lent_from", t)
