"""The kernel interfaces plugins implement: the jagged attention (with its optional parts,
:class:`AttentionExtras`, and the fused HSTU block it may offer), the norm-gate, the sequence tower's
two ends (its input and its pool) and the next-item loss. Registered per op: ``kernels.<op>: <name>``."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from gem_model.component_base import Component

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch


class Kernel(Component):
    """A compute kernel for one op. Kernels are registered per op: ``kernels.<op>: <name>``."""

    op: ClassVar[str]

    def check_available(self, device: torch.device) -> None:
        """Raise :class:`gem_model.errors.KernelUnavailableError` if this kernel cannot run on ``device``.

        Called once when the run is built, so that a misconfigured run fails before training starts,
        never by silently falling back to another kernel.
        """


@dataclass(frozen=True)
class AttentionExtras:
    """The optional parts of a jagged attention call, as one value (what HSTU adds to plain causal
    attention; see :class:`JaggedAttentionKernel` for the math).

    ``num_targets`` int ``[B]``: the last ``t`` positions of each sequence are targets (``None``: none);
    ``max_attn_len``: the window ``W`` (0: no window); ``position_bias`` ``[2 * max_seq_len - 1]`` and
    ``time_bias`` ``[num_buckets]``: the relative biases (differentiable), the time bias with
    ``timestamps`` and ``query_timestamps`` int ``[L]`` (each row's time as a key, and the time its
    query is asked at).
    """

    num_targets: torch.Tensor | None = None
    max_attn_len: int = 0
    position_bias: torch.Tensor | None = None
    time_bias: torch.Tensor | None = None
    timestamps: torch.Tensor | None = None
    query_timestamps: torch.Tensor | None = None


NO_EXTRAS = AttentionExtras()
"""Plain causal jagged attention: no targets, no window, no biases."""


class JaggedAttentionKernel(Kernel):
    """HSTU pointwise attention over jagged sequences.

    For rows ``i, j`` of the same sequence ``b`` (rows ``seq_offsets[b]:seq_offsets[b+1]``)::

        out_i = sum_j mask(i, j) * silu(alpha * <q_i, k_j> + r[j - i]) / max_seq_len * v_j

    With ``n`` the sequence length and ``t = num_targets[b]`` (0 when ``num_targets`` is None), the
    effective position is ``p(i) = min(i, n - t)`` and ``mask(i, j)`` holds when ``i == j`` or
    ``0 < p(i) - p(j) <= W`` (``W = max_attn_len``; ``W = 0`` means no window). History is causal;
    each target sees the history and itself only. No term crosses sequences.

    ``r`` is the optional relative attention bias (HSTU's, shared by the heads), the sum of
    ``position_bias[j - i + max_seq_len - 1]`` and, with ``time_bias``,
    ``time_bias[bucket(query_timestamps[i] - timestamps[j])]``
    (:func:`gem_model.jagged.time_buckets`); 0 when both are None. Only kernels with
    ``supports_position_bias`` / ``supports_time_bias`` take them; the model checks that before training.
    ``num_targets``, ``W`` and the biases travel together as one :class:`AttentionExtras`.

    Shapes: ``q, k`` ``[L, H, Dqk]``, ``v`` ``[L, H, Dv]``, ``seq_offsets`` int ``[B + 1]``; returns
    ``[L, H, Dv]`` in the dtype of ``v``.
    """

    op: ClassVar[str] = "jagged_attention"
    supports_position_bias: ClassVar[bool] = False
    supports_time_bias: ClassVar[bool] = False
    saved_formats: ClassVar[tuple[str, ...]] = ()
    """Formats (keys of :data:`gem_model.saved_format.SAVED_FORMATS`) in which the function of
    :meth:`fused_block` can store what it saves for backward, asked for by its ``saved_format``
    argument; empty (the default): none, and an activation policy compresses through hooks."""

    @abstractmethod
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        *,
        max_seq_len: int,
        alpha: float,
        extras: AttentionExtras = NO_EXTRAS,
    ) -> torch.Tensor: ...

    def fused_block(self, norm_gate: NormGateKernel) -> Callable[..., torch.Tensor] | None:
        """The HSTU block's whole forward as one function around its two linears, or ``None`` (the
        default: the block composes layer norm, the linears, ``silu``, the split, this kernel and
        ``norm_gate`` op by op; :mod:`gem_model.model.hstu`).

        The function computes ``x + out(norm_gate(attention(q, k, v), u))`` with
        ``u, v, q, k = split(silu(uvqk(layer_norm(x))))``::

            block(x, uvqk, out, gate_weight, gate_bias, seq_offsets, *, num_heads, attention_dim,
                  value_dim, max_seq_len, alpha, eps, extras[, saved_format])

        ``uvqk`` and ``out`` are the block's linears as callables (the precision scheme's modules,
        ``out`` with the block's dropout when that is active; its result is cast to ``x``'s dtype), so
        the GEMMs stay the scheme's, and a linear may take its input pre-quantized by the kernel that
        produced it (:mod:`gem_model.prequantized`); ``eps`` is the norm-gate's;
        the rest has the semantics of :meth:`__call__` and :class:`NormGateKernel`. A kernel offers it
        when it fuses the pointwise work around the GEMMs (gem-kernels' ``triton``);
        ``norm_gate`` is the run's configured norm-gate kernel, so a fused block can refuse kernels
        it does not implement (when the block is built). The block asks its current kernels for it
        at every forward, so a wrapper that replaces its attention and offers none (tensor and context
        parallelism) makes it compose the ops; so does ``torch.compile``. ``saved_format`` (one of
        :attr:`saved_formats`, passed only when the block's activation policy asks for it,
        :mod:`gem_model.saved_format`): the function's kernels store what they save for backward in
        that format; the outputs are those of the call without it, the gradients differ by its rounding.
        """
        return None


class NormGateKernel(Kernel):
    """The HSTU block's pointwise step: ``layer_norm(x) * weight + bias`` multiplied by the gate ``u``.

    ``x`` and ``u`` are ``[L, D]``; ``weight`` and ``bias`` are ``[D]``; returns ``[L, D]``.
    """

    op: ClassVar[str] = "norm_gate"

    @abstractmethod
    def __call__(
        self,
        x: torch.Tensor,
        u: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
    ) -> torch.Tensor: ...


class NextItemLossKernel(Kernel):
    """The next-item sampled softmax over jagged histories (the math: :mod:`gem_model.model.next_item`).

    ``query`` ``[L, D]`` (the tower's output per history row), ``items`` ``[L, D]`` (the history's item
    embeddings), ``negatives`` / ``negative_ids`` ``[B * K, D]`` / ``[B * K]`` shared by a sample's
    positions, or with ``per_position`` ``[P * K, D]`` / ``[P * K]`` in the order of the predicted
    positions; ``lengths`` ``[B]``, ``item_ids`` ``[L]``; ``host_lengths``: ``lengths`` on the host when
    the caller has them. Returns ``(loss sum, count)``: the sum over the predicted positions (every
    history row but its sequence's last) and their number, as 0-d tensors on ``query``'s device.
    """

    op: ClassVar[str] = "next_item_loss"

    @abstractmethod
    def __call__(
        self,
        query: torch.Tensor,
        items: torch.Tensor,
        negatives: torch.Tensor,
        lengths: torch.Tensor,
        item_ids: torch.Tensor,
        negative_ids: torch.Tensor,
        *,
        num_negatives: int,
        per_position: bool,
        l2_normalize: bool,
        temperature: float,
        host_lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class SequencePoolKernel(Kernel):
    """The sequence tower's last step: its final layer norm, then each sequence's history rows, last row
    and history mean.

    ``x [N, D]`` holds the rows of ``B`` sequences (sequence ``b``: rows ``offsets[b]:offsets[b+1]``):
    ``lead`` rows (0 or 1: the context token), then ``hist_lengths[b]`` history rows, then one candidate
    row when ``candidate``. With ``y = layer_norm(x) * weight + bias`` (statistics in float32, ``y`` in
    ``x``'s dtype; ``weight``, ``bias`` ``[D]``), returns, all in ``x``'s dtype:

    - ``hist [sum(hist_lengths), D]``: ``y`` of the history rows, sequence after sequence;
    - ``last [B, D]``: ``y`` of each sequence's last row (zeros for an empty sequence);
    - ``mean [B, D]``: the mean of each sequence's history rows of ``y``, summed in float32 (zeros
      where it has none).

    ``max_len`` bounds every sequence's length (the model's ``max_seq_len``), for kernels that size
    their launch by it on the host. A kernel reads no length back from the device.
    """

    op: ClassVar[str] = "sequence_pool"

    @abstractmethod
    def __call__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor,
        eps: float,
        offsets: torch.Tensor,
        hist_lengths: torch.Tensor,
        *,
        lead: int,
        candidate: bool,
        max_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


class SequenceInputKernel(Kernel):
    """The sequence tower's first step: each sequence's rows assembled from its history's embeddings.

    ``item`` and ``action`` (or None) ``[Nh, D]`` hold the history rows of ``B`` sequences, sequence after
    sequence (``hist_lengths [B]``). Sequence ``b``'s rows are ``first[b]`` when ``first`` is given (the
    context token), then its history rows ``item * scale + action``, then ``last[b]`` when ``last`` is
    given (the candidate); with ``position`` (the ``[P, D]`` table, ``P`` at least every sequence's
    length) each row at position ``p`` of its sequence gets ``position[p]`` added. Returns the rows
    ``[N, D]`` in ``dtype``: sequence ``b`` is rows ``offsets[b]:offsets[b+1]`` of the lengths
    ``hist_lengths + [first given] + [last given]``.

    ``max_len`` bounds every sequence's length (the model's ``max_seq_len``), for kernels that size
    their launch by it on the host. A kernel reads no length back from the device.
    """

    op: ClassVar[str] = "sequence_input"

    @abstractmethod
    def __call__(
        self,
        item: torch.Tensor,
        action: torch.Tensor | None,
        hist_lengths: torch.Tensor,
        *,
        scale: float,
        first: torch.Tensor | None,
        last: torch.Tensor | None,
        position: torch.Tensor | None,
        dtype: torch.dtype,
        max_len: int,
    ) -> torch.Tensor: ...
