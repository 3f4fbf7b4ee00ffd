"""The autograd function over the Triton jagged attention kernels (imports triton)."""

from __future__ import annotations

from typing import Any, Literal

import torch

from gem_kernels import attention_stored, attention_triton, attention_triton_bwd
from gem_kernels.attention_triton import query_major
from gem_kernels.attention_triton_bias import BiasGrads, RelativeBias, prepare_bias
from gem_kernels.attention_triton_bwd import key_major
from gem_kernels.launcher import config_str, key_label
from gem_model.api import NO_EXTRAS, AttentionExtras

DqMode = Literal["auto", "atomic", "separate", "stored"]

ATOMIC_DQ_BELOW_PAIRS = 2**24
"""``auto`` takes atomic dq below this many (query, key) pairs, estimated as ``H L^2 / (2 B)``.

On the H200 (2026-11-30, B = 512, H = 4, D = 128 bf16 unless noted; backward ms atomic / separate):
N = 256 s = 0.95 0.779 / 0.712 (6.0e7 pairs), N = 256 s = 0.3 0.284 / 0.310 (5.9e6), N = 1024 s = 0.95
5.698 / 5.034, N = 1024 s = 0.3 1.190 / 1.072 (9.3e7), N = 4096 s = 0.95 64.8 / 57.9, s = 0.3
10.8 / 9.88; MovieLens-like (B = 128, H = 2, D = 64, N = 200: 2.0e6) 0.249 / 0.447. The separate
pass wins from 6e7 pairs up (its two extra MMAs per tile pair cost less than the fp32 atomics, the
zeroed fp32 buffer and its cast); the two small batches, where the second kernel's launch and
drain do not pay off, favour atomics. 2^24 sits between the two groups."""


STORED_BY_DEFAULT = True
"""Whether ``auto`` takes ``stored`` where it took ``separate`` (a call it does not apply to, or whose buffer
does not fit, still recomputes: :mod:`gem_kernels.attention_stored`). On the H100 (2026-12-06, big config)
the step ran 1.015x (IQR 1.008-1.020) and 1.010x (1 / 0.990, IQR 1.002-1.018) over 40 batches at seeds
601 and 613, 1.008x and 1.006x in steady rounds (``benchmarks/results/e2e_ab.md``); the backward alone took
4.64 J against 4.89 and 4.51 against 4.72 a call (``kernel_energy.py``). Not yet measured on an H200. The
e2e switch ``dq_separate`` gives the recomputing pass back."""


def resolve_dq_mode(dq_mode: DqMode, num_rows: int, num_seqs: int,
                    num_heads: int) -> Literal["atomic", "separate", "stored"]:  # fmt: skip
    if dq_mode != "auto":
        return dq_mode
    pairs = num_heads * num_rows * num_rows / (2 * max(1, num_seqs))
    return "atomic" if pairs < ATOMIC_DQ_BELOW_PAIRS else ("stored" if STORED_BY_DEFAULT else "separate")


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    # The kernels take any row and head strides but address the last dim directly.
    return x if x.stride(-1) == 1 else x.contiguous()


class JaggedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        num_targets: torch.Tensor | None,
        max_seq_len: int,
        alpha: float,
        max_attn_len: int,
        dq_mode: DqMode,
        blocks: tuple[int, int] | None,
        position_bias: torch.Tensor | None,
        time_bias: torch.Tensor | None,
        bias: RelativeBias,
        fp8_forward: bool,
    ) -> torch.Tensor:
        # position_bias and time_bias are inputs only so that autograd routes their gradients;
        # the kernels read the prepared copies in ``bias``.
        q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
        out = forward(q, k, v, seq_offsets, num_targets, max_seq_len=max_seq_len, alpha=alpha,
                      max_attn_len=max_attn_len, blocks=blocks, bias=bias, fp8_forward=fp8_forward)  # fmt: skip
        # saved, not kept on ctx: autograd then checks that nothing changed them in place before backward;
        # the bf16 q, k, v also under fp8_forward (the backward is the bf16 forward's)
        ctx.save_for_backward(q, k, v, seq_offsets, num_targets, bias.position, bias.time, bias.timestamps,
                              bias.query_timestamps)
        ctx.params = (max_seq_len, alpha, max_attn_len, dq_mode, blocks, bias.edges)
        stored = (resolve_dq_mode(dq_mode, q.shape[0], seq_offsets.shape[0] - 1, q.shape[1]) == "stored"
                  and attention_stored.applies(q, k, bias, max_attn_len))  # fmt: skip
        ctx.score_plan = attention_stored.prepare(seq_offsets, q.shape[1]) if stored else None
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, seq_offsets, num_targets, *tables = ctx.saved_tensors
        max_seq_len, alpha, max_attn_len, dq_mode, blocks, edges = ctx.params
        dq, dk, dv, d_position, d_time = attention_backward(
            grad_out, q, k, v, seq_offsets, num_targets, RelativeBias(*tables, edges=edges),
            max_seq_len=max_seq_len, alpha=alpha, max_attn_len=max_attn_len, dq_mode=dq_mode, blocks=blocks,
            needs_position=ctx.needs_input_grad[10], needs_time=ctx.needs_input_grad[11], score_plan=ctx.score_plan,
        )
        return dq, dk, dv, None, None, None, None, None, None, None, d_position, d_time, None, None


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    *,
    max_seq_len: int,
    alpha: float,
    max_attn_len: int,
    blocks: tuple[int, int] | None,
    bias: RelativeBias,
    fp8_forward: bool,
) -> torch.Tensor:
    """The forward kernel on unit-stride ``q``, ``k``, ``v``; with ``fp8_forward``, on their e4m3 copies
    from one quantization pass (:mod:`gem_kernels.attention_fp8`)."""
    options = dict(max_seq_len=max_seq_len, alpha=alpha, max_attn_len=max_attn_len, blocks=blocks, bias=bias)
    if not fp8_forward:
        return query_major(q, k, v, None, seq_offsets, num_targets, **options)
    from gem_kernels.attention_fp8 import check_fp8_inputs, quantize_qk

    check_fp8_inputs(v)
    q8, k8, scales = quantize_qk(q, k)
    return query_major(q8, k8, v, None, seq_offsets, num_targets, fp8_scales=scales, **options)


def attention_backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    bias: RelativeBias,
    *,
    max_seq_len: int,
    alpha: float,
    max_attn_len: int,
    dq_mode: DqMode,
    blocks: tuple[int, int] | None,
    needs_position: bool,
    needs_time: bool,
    score_plan: attention_stored.ScorePlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``dq, dk, dv`` (contiguous) and the bias gradients (``None`` where not needed) of one call.
    ``score_plan``: the batch's plan from the forward, for ``dq_mode="stored"`` (without one, or when its
    buffer would pass the budget, ``dq`` is recomputed as ``separate`` does)."""
    grad_out = _unit_stride(grad_out)
    options = dict(max_seq_len=max_seq_len, alpha=alpha, max_attn_len=max_attn_len, blocks=blocks, bias=bias)
    grads = BiasGrads.zeros(bias, needs_position, needs_time, max_seq_len, q.device)
    mode = resolve_dq_mode(dq_mode, q.shape[0], seq_offsets.shape[0] - 1, q.shape[1])
    stored = None
    if mode == "stored" and score_plan is not None and attention_stored.applies(q, k, bias, max_attn_len):
        stored = score_plan.scores(q.dtype)
    if mode == "atomic":
        dq_accum = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk, dv = key_major(q, k, v, grad_out, seq_offsets, num_targets, dq_accum, bias_grads=grads, **options)
        dq = dq_accum.to(q.dtype)
    elif stored is not None:
        dq, dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))
        grads_from_stored(q, k, v, grad_out, seq_offsets, num_targets, stored, out=(dq, dk, dv), **options)
    else:
        dk, dv = key_major(q, k, v, grad_out, seq_offsets, num_targets, None, bias_grads=grads, **options)
        dq = query_major(q, k, v, grad_out, seq_offsets, num_targets, **options)
    d_position, d_time = grads.result(bias, max_seq_len)
    return dq, dk, dv, d_position, d_time


def grads_from_stored(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    grad_out: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    stored: attention_stored.StoredScores,
    *,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    max_seq_len: int,
    alpha: float,
    **options: Any,
) -> None:
    """``dk``, ``dv`` by the key-major pass, which stores its ``ds`` tiles in ``stored``, then ``dq`` from those
    tiles, into ``out = (dq, dk, dv)`` (``[L, H, D]``, unit last stride): ``stored.heads`` heads at a time, through
    the one buffer (:mod:`gem_kernels.attention_stored`). ``options``: the rest of :func:`key_major`'s."""
    dq, dk, dv = out
    group = stored.heads or q.shape[1]
    for h in range(0, q.shape[1], group):
        heads = slice(h, h + group)
        key_major(q[:, heads], k[:, heads], v[:, heads], grad_out[:, heads], seq_offsets, num_targets, None,
                  stored=stored, out=(dk[:, heads], dv[:, heads]), max_seq_len=max_seq_len, alpha=alpha, **options)  # fmt: skip
        attention_stored.dq_from_stored(stored, k[:, heads], seq_offsets, num_targets, max_seq_len=max_seq_len,
                                        alpha=alpha, out=dq[:, heads])  # fmt: skip


def jagged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    *,
    max_seq_len: int,
    alpha: float,
    extras: AttentionExtras = NO_EXTRAS,
    dq_mode: DqMode = "auto",
    blocks: tuple[int, int] | None = None,
    fp8_forward: bool = False,
) -> torch.Tensor:
    """Differentiable jagged HSTU attention (see :mod:`gem_kernels.attention_triton`), in ``q``, ``k``,
    ``v`` and the relative biases of ``extras`` (semantics of :class:`gem_model.api.JaggedAttentionKernel`
    and :class:`gem_model.api.AttentionExtras`).

    ``dq_mode``: how the backward gets ``dq`` (``auto``: see :data:`ATOMIC_DQ_BELOW_PAIRS`).
    ``blocks = (BLOCK_M, BLOCK_N)`` fixes the tile sizes instead of tuning them. ``fp8_forward``: the
    output from e4m3 ``q k^T`` (:mod:`gem_kernels.attention_fp8`, after one Triton pass that quantizes
    ``q`` and ``k``); the backward still reads the bf16 inputs. Without autograd
    (no grad mode, or no input that requires grad) the forward kernel runs directly, skipping the
    autograd function's bookkeeping: on small batches the host's launch work is what the call costs.
    Eager only: under ``torch.compile`` call the custom op
    :func:`gem_kernels.compiled_ops.jagged_attention_op` instead, which dynamo does not trace into
    (the registered ``triton`` kernel does so).
    """
    num_targets, max_attn_len = extras.num_targets, extras.max_attn_len
    position_bias, time_bias = extras.position_bias, extras.time_bias
    if not seq_offsets.is_contiguous():
        seq_offsets = seq_offsets.contiguous()
    if num_targets is not None and not num_targets.is_contiguous():
        num_targets = num_targets.contiguous()
    bias = prepare_bias(position_bias, time_bias, extras.timestamps, extras.query_timestamps, max_seq_len)
    leaves = (q, k, v, position_bias, time_bias)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in leaves)):
        return forward(
            _unit_stride(q), _unit_stride(k), _unit_stride(v), seq_offsets, num_targets, max_seq_len=max_seq_len,
            alpha=alpha, max_attn_len=max_attn_len, blocks=blocks, bias=bias, fp8_forward=fp8_forward,
        )
    return JaggedAttentionFunction.apply(
        q, k, v, seq_offsets, num_targets, max_seq_len, alpha, max_attn_len, dq_mode, blocks,
        position_bias, time_bias, bias, fp8_forward,
    )


KERNELS = {
    "forward": attention_triton.FORWARD,
    "dq": attention_triton.DQ,
    "dkdv": attention_triton_bwd.DKDV,
    "dkdv_atomic": attention_triton_bwd.DKDV_ATOMIC,
}


def autotuned_configs() -> dict[str, dict[str, Any]]:
    """What tuning chose so far, per kernel and tuning key, with every candidate's median ms (for
    benchmark records)."""
    found: dict[str, dict[str, Any]] = {}
    for kernel in KERNELS.values():
        found.update(kernel.records())
    return found


def last_configs() -> dict[str, str]:
    """Per kernel, the tuning key and config of its latest launch."""
    found = {}
    for name, kernel in KERNELS.items():
        if kernel.last is not None:
            key, config = kernel.last
            found[name] = f"{config_str(config)} [{key_label(kernel.key_names, key)}]"
    return found


def clear_last_configs() -> None:
    """Forget the latest launches, so that :func:`last_configs` then reports only those that follow."""
    for kernel in KERNELS.values():
        kernel.last = None
