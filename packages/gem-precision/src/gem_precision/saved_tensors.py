"""Saved-tensor hooks: fp8 compression of what autograd keeps for backward, and byte accounting.

:class:`Fp8SavedTensors` is a pair of ``saved_tensors_hooks`` (pack on save, unpack in backward).
A tensor is compressed only when it is an activation worth it: float32/bfloat16/float16, at least
``min_numel`` elements, a last dim of at least 32, and not a parameter (nor a cast or view of one,
such as the bfloat16 copy of a weight that a linear saves). Everything else is kept as it is.

Formats: ``block32`` stores MXFP8 (e4m3 + one e8m0 scale per 32 along the last dim,
:mod:`gem_precision.mx_reference`), 1 + 1/32 bytes per element; ``row`` stores e4m3 with one
power-of-two float32 scale per row (:mod:`gem_precision.fp8_reference`). CUDA tensors use the
Triton kernels, CPU tensors the torch references (the same bits). Unpacking returns the original
dtype and shape (contiguous).

A tensor saved several times (the same view of the same storage at the same version) is packed
once. The accounting counts what stays alive: each distinct storage once, plus the packed bytes.
Packed copies are held only by autograd's saved variables, so each is freed as soon as the last
backward node that saved it has run (the codec keeps weak references only); the original is freed
by whatever last used it in the forward (the codec never holds it). On CUDA both directions are
one Triton pass: no float32 temporary of a saved tensor.

What limits the step-time cost: bytes, not kernels. Compressing B bytes of bf16 activations reads B
and writes ~B/2 in the forward, reads ~B/2 and writes B in backward: ~3B of HBM traffic, against
~3.3-3.5 TB/s for these kernels (4.26 TB/s device copy). Per token a block of width d saves ~30d
bytes (15 KiB at d = 512 for the HSTU-like block) and runs ~30d**2 GEMM FLOPs (fwd + bwd), so

    compression time / GEMM time ~= 3 * 30d / BW  /  (30d**2 / F) = 3F / (BW * d) ~= 600 / d

with F ~= 700 TFLOP/s (bf16): about 1.2x the block's GEMM time at d = 512 (the benchmark measures
+10 ms on a 45.5 ms step, the traffic floor), ~15% at d = 4096. A few percent needs fewer saved
bytes (checkpointing), not a faster codec.

What limits the peak: the transient of the backward nodes, which no saved-tensor policy changes. In
the benchmark block, silu's backward holds grad_s, the saved h (dequantized) and grad_h, three
[L, 4d] bf16 tensors: 12 of ``none``'s 18 GiB, plus the 1 GiB output; and the forward keeps its
locals (the [L, 4d] silu output) alive until it returns, next to the packed copies. Compression
cuts what is kept between forward and backward (-48%), the peak much less (~-11% expected there).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from gem_precision.formats import E4M3
from gem_precision.fp8_reference import Fp8Operand, quantize_fp8_reference
from gem_precision.mx_reference import MXTensor, mx_dequantize, mx_quantize

SavedGranularity = Literal["block32", "row"]
COMPRESSIBLE = (torch.float32, torch.bfloat16, torch.float16)
MIN_LAST_DIM = 32
# autograd nodes that only cast or re-view their single input: a tensor reached from a parameter
# through these alone is that parameter in another dtype or shape, not an activation
_PASS_THROUGH = {
    "ToCopyBackward0", "TBackward0", "ViewBackward0", "TransposeBackward0", "PermuteBackward0",
    "ExpandBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1", "CloneBackward0",
    "AliasBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "SliceBackward0", "SelectBackward0",
}  # fmt: skip


@dataclass
class SavedTensorStats:
    """What a block kept for backward, in bytes (each distinct storage once)."""

    tensors: int = 0
    compressed: int = 0
    bytes_in: int = 0
    """Bytes the saved tensors' storages hold (what would be kept without compression)."""
    bytes_stored: int = 0
    """Bytes actually kept: uncompressed storages plus the fp8 payloads and scales."""
    kernel_forwards: int = 0
    """Forwards whose block compressed in its own kernels, with no hooks: none of their tensors is in
    the counts above."""

    def add(self, other: SavedTensorStats) -> None:
        for field in ("tensors", "compressed", "bytes_in", "bytes_stored", "kernel_forwards"):
            setattr(self, field, getattr(self, field) + getattr(other, field))


class _StorageSet:
    """Storages seen so far, by identity. Holds weak references only: a storage freed during the
    forward (after being packed) must not keep its memory, and a new storage that reuses its address
    or Python id must not be mistaken for it."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}

    def add(self, storage: torch.UntypedStorage) -> bool:
        """Add ``storage``; False if it was already there."""
        ref = self._refs.get(id(storage))
        if ref is not None and ref() is storage:
            return False
        self._refs[id(storage)] = weakref.ref(storage)
        return True


def is_parameter_like(t: torch.Tensor, parameter_ptrs: set[int]) -> bool:
    """A parameter, a tensor sharing a parameter's storage, or a cast/view chain from one."""
    if isinstance(t, nn.Parameter) or t.untyped_storage().data_ptr() in parameter_ptrs:
        return True
    fn = t.grad_fn
    while fn is not None:
        if type(fn).__name__ == "AccumulateGrad":
            return isinstance(getattr(fn, "variable", None), nn.Parameter)
        if type(fn).__name__ not in _PASS_THROUGH:
            return False
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def use_triton(t: torch.Tensor) -> bool:
    """Whether the codec runs the Triton kernels on ``t`` (CUDA) or the torch references (tests
    patch it to run the kernels under the interpreter)."""
    return t.device.type == "cuda"


class _Packed:
    """A compressed saved tensor. Only autograd's saved variables hold it (strongly): it is freed
    when the last backward node that saved it has run."""

    __slots__ = ("__weakref__", "dtype", "operand", "shape")

    def __init__(self, operand: MXTensor | Fp8Operand, shape: torch.Size, dtype: torch.dtype):
        self.operand, self.shape, self.dtype = operand, shape, dtype

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.operand.tensors())


class SavedBytesCounter:
    """Counts distinct storages once; shared by the plain counter and the fp8 packer."""

    def __init__(self) -> None:
        self.stats = SavedTensorStats()
        self._seen = _StorageSet()
        self._kept = _StorageSet()

    def count(self, t: torch.Tensor, stored: int | None) -> None:
        """Record one saved tensor; ``stored``: its packed bytes, or None when kept as it is."""
        self.stats.tensors += 1
        storage = t.untyped_storage()
        if self._seen.add(storage):
            self.stats.bytes_in += storage.nbytes()
        if stored is None:
            if self._kept.add(storage):  # a kept view keeps its whole storage alive
                self.stats.bytes_stored += storage.nbytes()
        else:
            self.stats.compressed += 1
            self.stats.bytes_stored += stored


class Fp8SavedTensors:
    """``pack``/``unpack`` for ``torch.autograd.graph.saved_tensors_hooks`` (one forward's worth)."""

    def __init__(self, *, granularity: SavedGranularity, min_numel: int, parameters: Iterable[torch.Tensor]):
        if granularity not in ("block32", "row"):
            raise ValueError(f"fp8 saved tensors: granularity must be 'block32' or 'row', got {granularity!r}")
        self.granularity = granularity
        self.min_numel = min_numel
        self.parameter_ptrs = {p.untyped_storage().data_ptr() for p in parameters}
        self.counter = SavedBytesCounter()
        # one packed copy per saved view: (storage id, view) -> (weak storage ref, weak packed ref).
        # Weak on both sides: the codec lives as long as any node that saved through it (its unpack
        # is stored with each saved variable), so a strong reference here kept every packed copy to
        # the end of backward, instead of freeing each one after its node ran (+2.7 GiB at the
        # benchmark's peak).
        self._packed: dict[tuple[Any, ...], tuple[weakref.ref[torch.UntypedStorage], weakref.ref[_Packed]]] = {}

    @property
    def stats(self) -> SavedTensorStats:
        return self.counter.stats

    def eligible(self, t: torch.Tensor) -> bool:
        return (
            t.dtype in COMPRESSIBLE
            and t.numel() >= self.min_numel
            and t.dim() >= 1
            and t.shape[-1] >= MIN_LAST_DIM
            and t.device.type != "meta"
            and not is_parameter_like(t, self.parameter_ptrs)
        )

    def pack(self, t: torch.Tensor) -> torch.Tensor | _Packed:
        if not self.eligible(t):
            self.counter.count(t, None)
            return t
        storage = t.untyped_storage()
        key = (id(storage), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype, t._version)
        hit = self._packed.get(key)
        if hit is not None and hit[0]() is storage:
            packed = hit[1]()
            if packed is not None:
                return packed
        packed = _Packed(self._quantize(t.detach()), t.shape, t.dtype)
        self._packed[key] = (weakref.ref(storage), weakref.ref(packed))
        self.counter.count(t, packed.nbytes())
        return packed

    def unpack(self, saved: torch.Tensor | _Packed) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        return self._dequantize(saved.operand, saved.dtype).view(saved.shape)

    def _quantize(self, t: torch.Tensor) -> MXTensor | Fp8Operand:
        t2d = t.reshape(-1, t.shape[-1])
        if t2d.stride(-1) != 1:  # the kernels take any row stride (e.g. a column slice), not this
            t2d = t2d.contiguous()
        on_gpu = use_triton(t2d)
        if self.granularity == "block32":
            if on_gpu:
                from gem_precision.mx_triton import mx_quantize_triton

                return mx_quantize_triton(t2d)[0]  # type: ignore[return-value]
            return mx_quantize(t2d)
        if on_gpu:  # one kernel: row amax in registers, no stats pass, no atomics
            from gem_precision.fp8_rows_triton import quantize_fp8_rows_triton

            return quantize_fp8_rows_triton(t2d)
        return quantize_fp8_reference(t2d, granularity="row", fmt=E4M3).rows  # type: ignore[return-value]

    @staticmethod
    def _dequantize(operand: MXTensor | Fp8Operand, dtype: torch.dtype) -> torch.Tensor:
        on_gpu = use_triton(operand.data)
        if isinstance(operand, Fp8Operand):
            if on_gpu:  # one pass to ``dtype``; the torch path builds a float32 copy of the whole tensor
                from gem_precision.fp8_rows_triton import dequantize_fp8_rows_triton

                return dequantize_fp8_rows_triton(operand, dtype)
            return operand.dequantize(dtype)
        if on_gpu:
            from gem_precision.mx_triton import mx_dequantize_triton

            return mx_dequantize_triton(operand, dtype)
        return mx_dequantize(operand, dtype)


class CountSavedTensors:
    """``saved_tensors_hooks`` that change nothing and count what is saved (the baseline)."""

    def __init__(self) -> None:
        self.counter = SavedBytesCounter()

    @property
    def stats(self) -> SavedTensorStats:
        return self.counter.stats

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.counter.count(t, None)
        return t

    @staticmethod
    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
