"""The fused HSTU gap in Triton: everything between the block's two GEMMs, forward and backward
(imports triton).

The gap of an HSTU block, from the ``uvqk`` projection's output ``pre`` ``[L, H (2 Dv + 2 Dqk)]``
(columns ``u, v, q, k``) to the output projection's input::

    u, v, q, k = split(silu(pre))
    y = norm_gate(jagged_attention(q, k, v), u)        # layer_norm(a) * weight + bias, times u

Unfused, the step writes ``silu(pre)`` whole, and its backward concatenates the four gradients into
one ``[L, 4 H D]`` tensor (a copy) and then multiplies it by ``silu'(pre)`` (a second pass over it
plus a read of ``pre``): on the H200's big config these passes took 23 ms of a 232 ms step.

Fused, every pass that remains is one that some kernel had to make anyway:

* forward: one kernel writes ``silu`` of the ``v, q, k`` columns only; the norm-gate kernel reads the
  ``u`` columns of ``pre`` and applies the silu itself;
* backward: the gradient of ``pre`` is one ``[L, 4 H D]`` buffer that the kernels write into, in
  place of the concatenation: the norm-gate backward writes the ``u`` columns already multiplied by
  ``silu'(u)``; the attention passes write ``dk``, ``dv`` and ``dq`` into theirs (with atomic ``dq``,
  the cast of its fp32 accumulator applies ``silu'`` too), and one pass multiplies those columns by
  ``silu'(pre)`` in place.

Why that last pass is not an epilogue of the attention kernels: there, loading a tile of ``pre`` beside
the two fp32 accumulators spilled registers in the key-major kernel's loops (216 bytes at its best
tile, ``compile_report``), and the epilogue cost more on the H200 (+10 ms a step on the big config)
than this pass (three column blocks read twice and written once). Tried again on 2026-12-05 with the
Gluon dk/dv pass (``pre``'s tiles by TMA into the key slots, ``silu'`` by ``tanh.approx``) and the Triton
dq pass, with the bias sums as atomic adds: on the H100 the epilogues took 1.67-2.07 ms a block for the
1.62-1.65 ms pass (the gap 0.914-0.968x). The attention passes issue-bound at two warps a scheduler, and
``silu'`` is O(L D) elementwise work, most of it in short tiles (``benchmarks/results/e2e_ab.md``).

No concatenation, no ``silu(u)`` tensor. The saved activations are ``pre``, ``silu`` of its ``v, q,
k`` columns and the attention output (one ``[L, H Dv]`` less than unfused). With ``saved_format=
"e4m3_row"`` (an activation policy asks for it through the block, :mod:`gem_model.saved_format`) they
are ``pre`` in e4m3 rows, written by the forward's silu pass, and the attention output in e4m3 rows,
written by the norm-gate's forward pass (which reads each row whole anyway); the backward expands
``silu(v, q, k)`` in one pass, the norm-gate backward reads ``u`` and the attention output from their
e4m3 rows, and the silu gradient reads the e4m3 columns (:mod:`gem_kernels.hstu_gap_saved` has the bytes).

With ``fp8_forward`` the silu pass of the ``q, k`` columns also writes their e4m3 copies and scales, which
the attention forward reads (:mod:`gem_kernels.attention_fp8`); ``post`` and the backward are unchanged.
Under ``saved_format="e4m3_row"`` the silu pass is the saved format's, and one more pass quantizes the
``q, k`` it wrote (the same values, so the same e4m3 copies).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from gem_kernels import attention_stored
from gem_kernels.attention_fp8 import quantize_qk, silu_quantize_qk
from gem_kernels.attention_triton import query_major
from gem_kernels.attention_triton_autograd import DqMode, grads_from_stored, resolve_dq_mode
from gem_kernels.attention_triton_bias import BiasGrads, RelativeBias
from gem_kernels.attention_triton_bwd import key_major
from gem_kernels.attention_triton_common import INTERPRET, cast, device_guard, silu_grad
from gem_kernels.hstu_gap_bias import silu_grad_columns
from gem_kernels.hstu_gap_grad_rows import complete_with_rows, fits, silu_grad_rows
from gem_kernels.hstu_gap_saved import expand_rows, silu_quantize_rows
from gem_kernels.norm_gate_triton import NormGateFunction, norm_gate_backward
from gem_kernels.quantized_rows_triton import RowsOut, dequantize_rows, load_rows
from gem_model.api import E4M3_ROW, NO_EXTRAS, AttentionExtras, GradRowsSlot, PrequantizedRows, RowQuantization

ROWS, COLS = (4, 64) if INTERPRET else (16, 256)
U_SUMS_IN_NORM_GATE = True
"""Where the gap sums the ``uvqk`` bias's gradient in one pass over whole rows (the bf16 step) and the
norm-gate backward reads bf16 (not ``fp8_saved``'s e4m3 rows, where the sums would spill 40 bytes), that
backward sums the ``u`` columns as it writes them, and the last pass reads only the ``v, q, k`` columns
(``silu_grad_rows``' ``u_summed``): 2 of its 20 KiB a token fewer at the big config. On the H100
(2026-12-07, ``benchmarks/gap_bias_sums.py``, 40 rotated rounds) the two kernels took 2.510 ms against 2.559
at 207,000 rows (1.019x) and 2.080 against 2.146 at 180,000 (1.032x), the same gradient bit for bit: ~0.4 ms
of a ~184 ms step, below what a step's A/B resolves (not timed in a step). False: the last pass reads and
sums the ``u`` columns too, as before (e2e switch ``u_sums_in_grad_rows``)."""
SAVED_ATTENTION_E4M3 = True
"""Under ``saved_format="e4m3_row"``, the attention output is kept in e4m3 rows too (written by the
norm-gate's forward pass, read by its backward: :data:`E4M3_ROWS_IN_NORM_GATE`); False keeps it as computed."""
E4M3_ROWS_IN_NORM_GATE = True
"""Under ``saved_format="e4m3_row"``: True, the norm-gate backward reads the gate ``u`` and the attention
output from their e4m3 rows in its own loop, as 16-bit words (``quantized_rows_triton.load_e4m3_pairs``),
and the expand pass writes only ``silu(v, q, k)``: 8 KiB a token a block less traffic. False, the
expand pass writes ``u`` and one more pass the attention output in the activation dtype first. The same
values either way. On the H200 (2026-12-04, big config, seed 239) True took ``fp8_saved``'s step cost
from 7.4 % to 5.3 % (``benchmarks/results/e2e_ab.md``); the norm-gate backward reading the rows runs in
0.50 ms against 0.59 ms reading bf16 at 200,000 x 1,024."""


@triton.jit
def _silu_columns(X, PRE, SCALE_INV, OUT, stride_x, stride_pre, stride_out, num_rows, num_cols,
                  GRAD: tl.constexpr, E4M3: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                  INTERP: tl.constexpr):  # fmt: skip
    """``OUT = silu(PRE)`` (``GRAD`` false: ``X`` unused), or ``OUT = X * silu'(PRE)`` (``GRAD``), over a
    ``[num_rows, num_cols]`` window of each (row strides given, unit column stride). ``E4M3``: ``PRE`` is
    e4m3 bytes, each row times its ``SCALE_INV`` (:mod:`gem_kernels.hstu_gap_saved`)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = tl.program_id(1) * COLS + tl.arange(0, COLS)
    rows_ok = rows < num_rows
    inside = rows_ok[:, None] & (cols < num_cols)[None, :]
    z = load_rows(PRE, SCALE_INV, rows, cols, rows_ok, inside, stride_pre, E4M3)
    if GRAD:
        g = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        result = g * silu_grad(z)
    else:
        result = z * tl.sigmoid(z)
    tl.store(OUT + rows[:, None] * stride_out + cols[None, :], cast(result, OUT.dtype.element_ty, INTERP), mask=inside)


def silu_columns(pre: torch.Tensor, out: torch.Tensor, grad: torch.Tensor | None = None,
                 scale_inv: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """``out[:] = silu(pre)``, or with ``grad``, ``out[:] = grad * silu'(pre)``; all three ``[rows, cols]``
    with unit column stride (views of wider tensors are fine). With ``scale_inv`` ``[rows]``, ``pre`` is
    e4m3 and stands for ``pre * scale_inv[:, None]``."""
    num_rows, num_cols = pre.shape
    if num_rows:
        x = grad if grad is not None else pre
        e4m3 = scale_inv is not None
        with device_guard(pre.device):
            _silu_columns[(triton.cdiv(num_rows, ROWS), triton.cdiv(num_cols, COLS))](
                x, pre.view(torch.uint8) if e4m3 else pre, scale_inv if e4m3 else pre, out, x.stride(0), pre.stride(0),
                out.stride(0), num_rows, num_cols, GRAD=grad is not None, E4M3=e4m3, ROWS=ROWS, COLS=COLS,
                INTERP=INTERPRET, num_warps=4,
            )  # fmt: skip
    return out


class HSTUGapFunction(torch.autograd.Function):
    """``pre -> y`` of one HSTU block (see the module docstring), differentiable in ``pre``, the gate's
    weight and bias, and the relative bias tables."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        pre: torch.Tensor,
        gate_weight: torch.Tensor,
        gate_bias: torch.Tensor,
        position_bias: torch.Tensor | None,
        time_bias: torch.Tensor | None,
        pre_bias: torch.Tensor | None,
        seq_offsets: torch.Tensor,
        num_targets: torch.Tensor | None,
        bias: RelativeBias,
        shape: tuple[int, int, int],
        options: dict[str, Any],
    ) -> torch.Tensor:
        # position_bias and time_bias are inputs only so that autograd routes their gradients; the
        # kernels read the prepared copies in ``bias``. So is pre_bias, the uvqk linear's bias, whose
        # gradient the backward sums when it is given (hstu_gap_bias): pre already holds it.
        heads, dqk, dv = shape
        ctx.pre_bias_dtype = pre_bias.dtype if pre_bias is not None and ctx.needs_input_grad[5] else None
        rows, hv, hq = pre.shape[0], heads * dv, heads * dqk
        given_post = options.pop("post")  # written by the uvqk GEMM's epilogue (gem_kernels.linear_epilogue_triton)
        post = torch.empty((rows, hv + 2 * hq), dtype=pre.dtype, device=pre.device) if given_post is None else given_post
        # e4m3_row: pre kept in e4m3 rows written by the silu pass, post recomputed in backward
        ctx.expand_to = pre.dtype if options["saved_format"] == E4M3_ROW and any(ctx.needs_input_grad) else None
        fp8 = None
        if ctx.expand_to is not None:
            kept = silu_quantize_rows(pre, post, hv)
        elif options["fp8_forward"]:  # the silu pass of q, k also writes their e4m3 copies (attention_fp8)
            silu_columns(pre[:, hv:2 * hv], post[:, :hv])
            fp8 = silu_quantize_qk(pre[:, 2 * hv:], post[:, hv:], heads)
            kept = (pre, post)
        elif given_post is not None:
            kept = (pre, post)
        else:
            kept = (pre, silu_columns(pre[:, hv:], post))
        v, q, k = (post[:, a:b].view(rows, heads, -1) for a, b in ((0, hv), (hv, hv + hq), (hv + hq, hv + 2 * hq)))
        if ctx.expand_to is not None and options["fp8_forward"]:
            # silu_quantize_rows wrote post as silu_columns does; the e4m3 q, k come from one more pass over them
            fp8 = quantize_qk(q, k)
        if fp8 is None:
            attn = query_major(q, k, v, None, seq_offsets, num_targets, bias=bias, **_kernel_options(options))
        else:  # the backward reads the bf16 q, k, v of post, as without fp8
            attn = query_major(fp8[0], fp8[1], v, None, seq_offsets, num_targets, bias=bias, fp8_scales=fp8[2],
                               **_kernel_options(options))  # fmt: skip
            del fp8
        quantize = options["quantize"]
        rows_out = None if quantize is None else RowsOut.allocate(rows, hv, pre.device, quantize)
        # e4m3_row: the norm-gate's pass also writes the attention output's e4m3 rows, kept in its place
        keep_rows = ctx.expand_to is not None and SAVED_ATTENTION_E4M3
        attn_rows = RowsOut.allocate(rows, hv, pre.device, RowQuantization()) if keep_rows else None
        y, mean, rstd = NormGateFunction.run_forward(attn.view(rows, hv), pre[:, :hv], gate_weight, gate_bias,
                                                     options["eps"], silu_gate=True, rows_out=rows_out,
                                                     x_rows=attn_rows)  # fmt: skip
        kept_attn = (attn,) if attn_rows is None else (attn_rows.data.view(torch.float8_e4m3fn), attn_rows.scale_inv)
        del attn  # freed here when kept in e4m3 rows
        ctx.kept_attn = len(kept_attn)  # the attention output, or its e4m3 rows and their scales
        ctx.save_for_backward(*kept, *kept_attn, mean, rstd, gate_weight, gate_bias, seq_offsets, num_targets,
                              bias.position, bias.time, bias.timestamps, bias.query_timestamps)  # fmt: skip
        ctx.params = (shape, options, bias.edges)
        # dq from the dk/dv pass's stored ds tiles: the batch's tile count starts on its way to the host here
        stored = (resolve_dq_mode(options["dq_mode"], rows, seq_offsets.shape[0] - 1, heads) == "stored"
                  and attention_stored.applies(q, k, bias, options["max_attn_len"]) and any(ctx.needs_input_grad))
        ctx.score_plan = attention_stored.prepare(seq_offsets, heads) if stored else None
        if rows_out is None:
            return y
        ctx.mark_non_differentiable(*rows_out.tensors())  # y's e4m3 rows, for the output projection
        ctx.set_materialize_grads(False)  # no zero gradients made up for them
        return y, rows_out.data, rows_out.scale_inv, rows_out.column_amax_bits

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor, *_rows: None) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        (heads, dqk, dv), options, edges = ctx.params
        hv, hq = heads * dv, heads * dqk
        pre, scale_inv, post, (u, u_scale_inv), (attn, attn_scale_inv), rest = _kept_for_backward(ctx, hv)
        mean, rstd, weight, gate_bias, seq_offsets, num_targets, *tables = rest
        rows = pre.shape[0]
        act_dtype = pre.dtype if ctx.expand_to is None else ctx.expand_to
        d_pre = torch.empty(pre.shape, dtype=act_dtype, device=pre.device)
        # the column sums of d_pre, from the passes that write it: the uvqk bias's gradient (hstu_gap_bias)
        sums = None if ctx.pre_bias_dtype is None else torch.empty(pre.shape[1], dtype=torch.float32, device=pre.device)
        grad_rows: GradRowsSlot | None = options["grad_rows"] if fits(pre.shape[1]) else None
        # the bias sums without rows: one pass over whole rows when they fit (hstu_gap_bias), else per column block
        # with the u columns by a reduction of their own; the u columns' sums by the norm-gate backward that
        # writes them, where it is asked to (U_SUMS_IN_NORM_GATE)
        sum_rows = sums is not None and grad_rows is None and fits(pre.shape[1])
        in_norm_gate = sum_rows and U_SUMS_IN_NORM_GATE and u_scale_inv is None and attn_scale_inv is None
        u_sums = torch.empty(hv, dtype=torch.float32, device=pre.device) if in_norm_gate else None
        d_attn, _, d_weight, d_gate_bias = norm_gate_backward(
            dy.reshape(rows, hv), attn.view(rows, hv), u, weight, gate_bias, mean, rstd, silu_gate=True,
            du_out=d_pre[:, :hv], x_scale_inv=attn_scale_inv, u_scale_inv=u_scale_inv, du_sum_out=u_sums,
        )
        if sums is not None and grad_rows is None and not sum_rows:
            torch.sum(d_pre[:, :hv], 0, dtype=torch.float32, out=sums[:hv])
        del u  # the expanded gate's memory is free for the attention backward

        def heads_of(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
            return t[:, a:b].view(rows, heads, -1)

        v, q, k = heads_of(post, 0, hv), heads_of(post, hv, hv + hq), heads_of(post, hv + hq, hv + 2 * hq)
        d_v, d_q, d_k = heads_of(d_pre, hv, 2 * hv), heads_of(d_pre, 2 * hv, 2 * hv + hq), heads_of(d_pre, 2 * hv + hq, 2 * hv + 2 * hq)
        bias = RelativeBias(*tables, edges=edges)
        kernel = _kernel_options(options)
        grads = BiasGrads.zeros(bias, ctx.needs_input_grad[3], ctx.needs_input_grad[4], kernel["max_seq_len"], pre.device)
        d_attn = d_attn.view(rows, heads, dv)
        mode = resolve_dq_mode(options["dq_mode"], rows, seq_offsets.shape[0] - 1, heads)
        dq_accum = torch.zeros((rows, heads, dqk), dtype=torch.float32, device=pre.device) if mode == "atomic" else None
        plan = ctx.score_plan
        stored = plan.scores(post.dtype) if mode == "stored" and plan is not None else None
        dq_done = stored is not None
        if dq_done:  # dk, dv and dq, a group of heads at a time
            grads_from_stored(q, k, v, d_attn, seq_offsets, num_targets, stored, out=(d_q, d_k, d_v), bias=bias,
                              **kernel)  # fmt: skip
            del stored  # the tiles' memory is free for the passes below
        else:
            key_major(q, k, v, d_attn, seq_offsets, num_targets, dq_accum, bias=bias, bias_grads=grads,
                      out=(d_k, d_v), **kernel)  # fmt: skip
        q_cols, k_cols, v_cols = slice(2 * hv, 2 * hv + hq), slice(2 * hv + hq, 2 * hv + 2 * hq), slice(hv, 2 * hv)
        if dq_accum is not None:
            passes = [(q_cols, dq_accum.view(rows, hq))] + [(c, d_pre[:, c]) for c in (v_cols, k_cols)]
        else:
            if not dq_done:
                query_major(q, k, v, d_attn, seq_offsets, num_targets, bias=bias, out=d_q, **kernel)
            every = slice(hv, 2 * hv + 2 * hq)  # v, q, k: one pass, in place
            passes = [(every, d_pre[:, every])]
        if grad_rows is not None:  # one pass over whole rows, writing d_pre's e4m3 rows too (hstu_gap_grad_rows)
            sums = complete_with_rows(pre, d_pre, hv, grad_rows, dq_accum, q_cols, scale_inv, sums is not None)
            passes = []
        elif sum_rows:  # the same pass without rows: the column sums of the whole gradient
            dq = None if dq_accum is None else (dq_accum.view(rows, hq), q_cols)
            sums = silu_grad_rows(pre, d_pre, hv, None, dq=dq, scale_inv=scale_inv, col_sum=True,
                                  u_summed=u_sums is not None)  # fmt: skip
            if u_sums is not None:
                sums[:hv] = u_sums
            passes = []
        for cols, grad in passes:
            if sums is None:
                silu_columns(pre[:, cols], d_pre[:, cols], grad=grad, scale_inv=scale_inv)
            else:
                sums[cols] = silu_grad_columns(pre[:, cols], d_pre[:, cols], grad, scale_inv=scale_inv)
        d_position, d_time = grads.result(bias, kernel["max_seq_len"])
        d_pre_bias = None if sums is None else sums.to(ctx.pre_bias_dtype)
        return d_pre, d_weight, d_gate_bias, d_position, d_time, d_pre_bias, None, None, None, None, None


def _kept_for_backward(ctx: Any, hv: int) -> tuple[Any, ...]:
    """What the gap's backward reads, from what its forward kept: ``pre`` (or, under the saved format, its
    e4m3 rows) and their scales (None as computed); ``post`` in the activation dtype; the gate ``u`` and
    the attention output as the norm-gate backward reads them, each with its scales when that kernel
    reads their e4m3 rows in its loop (:data:`E4M3_ROWS_IN_NORM_GATE`), else None (expanded first, or
    kept as computed); and the rest of the saved tensors."""
    saved = ctx.saved_tensors
    (pre, post), (attn, *attn_scale_inv), rest = saved[:2], saved[2:2 + ctx.kept_attn], saved[2 + ctx.kept_attn:]
    if ctx.expand_to is None:
        return pre, None, post, (pre[:, :hv], None), (attn, None), rest
    scale_inv = post  # pre: e4m3 rows, post: their scales (hstu_gap_saved)
    in_loop = E4M3_ROWS_IN_NORM_GATE and hv % 2 == 0
    u, post = expand_rows(pre, scale_inv, hv, ctx.expand_to, gate=not in_loop)
    gate = (pre[:, :hv], scale_inv) if in_loop else (u, None)
    if not attn_scale_inv:  # kept as computed (SAVED_ATTENTION_E4M3 off)
        return pre, scale_inv, post, gate, (attn, None), rest
    if in_loop:
        return pre, scale_inv, post, gate, (attn, attn_scale_inv[0]), rest
    return pre, scale_inv, post, gate, (dequantize_rows(attn, attn_scale_inv[0], ctx.expand_to), None), rest


def _check_post(post: torch.Tensor, pre: torch.Tensor, hv: int, options: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``post`` can stand for the silu pass's output under ``options``."""
    if options["saved_format"] is not None or options["fp8_forward"]:
        raise ValueError("hstu_gap: post (from the uvqk GEMM's epilogue) cannot be given with saved_format or "
                         "fp8_forward, whose silu passes write more than post")  # fmt: skip
    want = (pre.shape[0], pre.shape[1] - hv)
    if post.shape != want or post.dtype != pre.dtype or post.device != pre.device or not post.is_contiguous():
        raise ValueError(f"hstu_gap: post must be a contiguous {pre.dtype} {list(want)} on {pre.device} "
                         f"(silu of pre's v, q, k columns), got {post.dtype} {list(post.shape)} on {post.device}")  # fmt: skip


def _kernel_options(options: dict[str, Any]) -> dict[str, Any]:
    return {k: options[k] for k in ("max_seq_len", "alpha", "max_attn_len", "blocks")}


def hstu_gap_triton(
    pre: torch.Tensor,
    gate_weight: torch.Tensor,
    gate_bias: torch.Tensor,
    seq_offsets: torch.Tensor,
    *,
    num_heads: int,
    attention_dim: int,
    value_dim: int,
    max_seq_len: int,
    alpha: float,
    eps: float,
    extras: AttentionExtras = NO_EXTRAS,
    dq_mode: DqMode = "auto",
    blocks: tuple[int, int] | None = None,
    quantize: RowQuantization | None = None,
    saved_format: str | None = None,
    fp8_forward: bool = False,
    pre_bias: torch.Tensor | None = None,
    grad_rows: GradRowsSlot | None = None,
    post: torch.Tensor | None = None,
) -> tuple[torch.Tensor, PrequantizedRows | None]:
    """The fused gap ``pre -> y`` (``[L, H (2 Dv + 2 Dqk)] -> [L, H Dv]``); attention arguments as in
    :func:`gem_kernels.attention_triton_autograd.jagged_attention_triton`, ``eps`` the norm-gate's.
    Returns ``y`` and, with ``quantize``, its rows quantized so by the norm-gate's pass (else None).
    ``saved_format``: None keeps ``pre`` and ``silu(v, q, k)`` for backward as computed; ``"e4m3_row"``
    keeps ``pre`` in e4m3 rows instead (:mod:`gem_kernels.hstu_gap_saved`; ignored without grad).
    ``fp8_forward``: the attention's ``q k^T`` in e4m3, quantized by the silu pass (:mod:`gem_kernels.attention_fp8`).
    ``pre_bias``: the bias already added into ``pre`` (the ``uvqk`` linear's, lent by
    ``gem_model.api.bias_grad_elsewhere``), whose gradient the backward then sums (:mod:`gem_kernels.hstu_gap_bias`).
    ``grad_rows``: the ``uvqk`` linear's slot (``gem_model.api.GradRowsSlot``), offered the e4m3 rows of
    ``pre``'s gradient by the backward's last pass (:mod:`gem_kernels.hstu_gap_grad_rows`).
    ``post``: ``silu(pre[:, H Dv:])``, already written by the ``uvqk`` GEMM's epilogue
    (:mod:`gem_kernels.linear_epilogue_triton`): the forward's silu pass is skipped (not with ``saved_format``
    or ``fp8_forward``, whose silu passes write more)."""
    if grad_rows is not None and not isinstance(grad_rows, GradRowsSlot):
        raise TypeError(f"hstu_gap: grad_rows must be a gem_model.api.GradRowsSlot, got {type(grad_rows).__name__}")
    if saved_format not in (None, E4M3_ROW):
        raise ValueError(f"hstu_gap: saved_format must be None or {E4M3_ROW!r}, got {saved_format!r}")
    if fp8_forward:
        from gem_kernels.attention_fp8 import check_fp8_inputs

        check_fp8_inputs(pre)
    num_targets, max_attn_len = extras.num_targets, extras.max_attn_len
    position_bias, time_bias = extras.position_bias, extras.time_bias
    from gem_kernels.attention_triton_bias import prepare_bias

    width = num_heads * (2 * value_dim + 2 * attention_dim)
    if pre.dim() != 2 or pre.shape[1] != width:
        raise ValueError(f"hstu_gap: pre must be [L, {width}] (H (2 Dv + 2 Dqk)), got {tuple(pre.shape)}")
    if pre.stride(-1) != 1:
        pre = pre.contiguous()
    seq_offsets = seq_offsets.contiguous()
    num_targets = num_targets.contiguous() if num_targets is not None else None
    bias = prepare_bias(position_bias, time_bias, extras.timestamps, extras.query_timestamps, max_seq_len)
    options = dict(max_seq_len=max_seq_len, alpha=float(alpha), max_attn_len=max_attn_len, blocks=blocks,
                   dq_mode=dq_mode, eps=eps, quantize=quantize, fp8_forward=fp8_forward, grad_rows=grad_rows,
                   saved_format=saved_format if torch.is_grad_enabled() else None, post=post)  # fmt: skip
    if post is not None:
        _check_post(post, pre, num_heads * value_dim, options)
    if pre_bias is not None and pre_bias.shape != (width,):
        raise ValueError(f"hstu_gap: pre_bias must be [{width}] (uvqk's bias), got {tuple(pre_bias.shape)}")
    out = HSTUGapFunction.apply(pre, gate_weight, gate_bias, position_bias, time_bias, pre_bias, seq_offsets,
                                num_targets, bias, (num_heads, attention_dim, value_dim), options)  # fmt: skip
    if quantize is None:
        return out, None
    y, data, scale_inv, column_amax = out
    return y, RowsOut(data, scale_inv, column_amax).result()
