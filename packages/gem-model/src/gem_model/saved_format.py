"""Saved activations compressed by the kernels that produce them: the contract between an activation
policy and a block whose kernels can do it.

An activation policy that shrinks what a block keeps for backward (gem-precision's ``fp8_saved``) can
do it for any block through ``saved_tensors_hooks``, but those run Python for every saved tensor and
a pass of their own over it. A block whose fused kernels can write the compressed copy in the pass
that produces the tensor, and expand it in the backward kernels that read it, offers that instead as
a :class:`SavedFormatBlock`:

- the policy sets ``block.saved_format`` (a key of :data:`SAVED_FORMATS`) when it wraps the block;
- at each forward it asks ``block.saves_in_kernels()``. True: this forward, with the block's kernels
  as they are now, stores what those kernels save in ``saved_format`` itself, so the policy adds no
  hooks. False (the op-by-op path, ``torch.compile``, a kernel that offers no such format): the
  forward saves as computed, and the policy compresses through its hooks.

The core's HSTU block implements it through its attention kernel's fused block
(``JaggedAttentionKernel.saved_formats``, the ``saved_format`` argument of the fused block's function).
What the block's other modules save (e.g. a linear's input) is not covered by ``saved_format``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

E4M3_ROW = "e4m3_row"
"""fp8 e4m3 with one power-of-two float32 scale per row: ``2**s`` with ``s`` the largest integer such
that ``amax * 2**s <= 448``, clamped to [-126, 126]; a row holding a NaN or an infinity is stored as
NaN (every byte 0x7F, a NaN scale). The rule and bits of gem-precision's row quantizer
(``gem_precision.fp8_reference``, row granularity)."""

SAVED_FORMATS: dict[str, str] = {
    E4M3_ROW: "fp8 e4m3, one power-of-two float32 scale per row (gem-precision's row quantizer)",
}
"""The formats a block's kernels may store saved activations in, and what each is."""


@runtime_checkable
class SavedFormatBlock(Protocol):
    """A block (``nn.Module``) whose kernels can store what they save for backward in a compressed format.

    ``saved_format``: None (save as computed, the default) or a key of :data:`SAVED_FORMATS`; an
    activation policy sets it when it wraps the block.
    """

    saved_format: str | None

    def saves_in_kernels(self) -> bool:
        """Whether a forward run now stores what the block's kernels save in ``saved_format`` (False
        when ``saved_format`` is None). Asked at every forward: the path a forward takes may change
        between forwards (a kernel option, a wrapper that replaces a kernel, ``torch.compile``)."""
        ...
