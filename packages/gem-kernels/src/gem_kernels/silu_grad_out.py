"""An attention gradient pass that stores its output already multiplied by ``silu'(pre)``, and sums
what it stores per column (imports triton).

In the fused HSTU gap (:mod:`gem_kernels.hstu_gap_triton`) the attention reads ``q, k, v = silu(pre)``
columns of the ``uvqk`` projection's output, so the gradient of ``pre`` is each attention gradient
times ``silu'`` of its own ``pre`` columns, and the ``uvqk`` bias's gradient is the column sum of that.
A :class:`SiluGradOut` handed to ``query_major``'s ``dq`` pass or to ``key_major`` asks the kernel to
do both before its store: it loads the tile of ``pre`` at the same rows and columns as its output
tile, multiplies its float32 result by ``silu'`` before the one rounding to the output's dtype, and
adds the column sums of the values as stored (float32) into ``sums`` with atomic adds (one per column
of a tile: their order varies from run to run, so the sums' last bits do too).

A route whose kernel has no such epilogue (the Triton ``key_major`` kernel, the Gluon ``dq`` pass, the
warp-specialized Gluon dk/dv pass) stores its gradient as usual and :meth:`SiluGradOut.finish` then
makes the same result in one pass over it (:func:`gem_kernels.hstu_gap_bias.silu_grad_columns`: two
roundings instead of one, deterministic sums).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SiluGradOut:
    """What a gradient pass multiplies its output ``[L, H, D]`` by before storing it: ``silu'(pre)``,
    ``pre`` a tensor of the output's shape, strides and dtype (the output's columns of the tensor whose
    gradient it is); and where it adds the column sums of what it stores: ``sums``, float32 ``[H D]``
    (contiguous, zeroed by the caller), or None."""

    pre: torch.Tensor
    sums: torch.Tensor | None = None

    def check(self, out: torch.Tensor, where: str) -> None:
        """Raise ``ValueError``, naming ``where``, unless this can stand beside ``out``."""
        pre = self.pre
        if pre.shape != out.shape or pre.stride() != out.stride() or pre.dtype != out.dtype or pre.device != out.device:
            raise ValueError(
                f"{where}: silu_pre.pre must have the output's shape, strides, dtype and device: pre "
                f"{pre.dtype} {tuple(pre.shape)} strides {pre.stride()} on {pre.device}, output {out.dtype} "
                f"{tuple(out.shape)} strides {out.stride()} on {out.device}"
            )
        if pre.dim() != 3 or pre.stride(2) != 1 or pre.stride(1) != pre.shape[2]:
            raise ValueError(f"{where}: silu_pre.pre must be [L, H, D] with its heads side by side in a row, "
                             f"got {tuple(pre.shape)} strides {pre.stride()}")  # fmt: skip
        sums = self.sums
        width = pre.shape[1] * pre.shape[2]
        if sums is not None and (sums.shape != (width,) or sums.dtype != torch.float32 or not sums.is_contiguous()
                                 or sums.device != pre.device):  # fmt: skip
            raise ValueError(f"{where}: silu_pre.sums must be a contiguous float32 [{width}] on {pre.device}, got "
                             f"{sums.dtype} {tuple(sums.shape)} on {sums.device}")  # fmt: skip

    def finish(self, out: torch.Tensor) -> None:
        """The epilogue as a pass of its own over ``out``, stored without it: ``out *= silu'(pre)`` in
        place, and its column sums added into ``sums``."""
        from gem_kernels.hstu_gap_bias import silu_grad_columns

        rows = out.shape[0]
        flat = out.view(rows, -1)
        column_sums = silu_grad_columns(self.pre.view(rows, -1), flat, flat)
        if self.sums is not None:
            self.sums.add_(column_sums)
