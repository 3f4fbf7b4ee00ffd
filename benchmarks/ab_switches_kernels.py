"""The kernel switches of ``benchmarks/e2e_ab.py`` (:mod:`ab_switches` has the others and the contract):
a model's kernel swapped for another registered one (the next-item loss, the sequence tower's two ends),
and gem-kernels' module flags turned to their other setting (pipelining, loads, the Gluon passes, the
GEMM epilogues, the loss's unit rows).
"""

from __future__ import annotations

from collections.abc import Callable

from ab_patch import Switch, all_of, patched  # beside this script


def switch_torch_loss(run: object) -> Callable[[], None]:
    """The next-item loss by gem-model's ``torch`` kernel (``TorchNextItemLoss``, the chunked GEMMs and
    per-row torch passes of ``gem_model.model.next_item``) instead of the run's ``kernels.next_item_loss``
    (gem-kernels' ``triton`` in ``configs/h200-large.yaml``): the model's ``loss_kernel`` swapped."""
    from gem_model.model.next_item import TorchNextItemLoss

    model = run.model  # type: ignore[attr-defined]
    before = model.loss_kernel
    model.loss_kernel = TorchNextItemLoss()

    def undo() -> None:
        model.loss_kernel = before

    return undo


def _tower_end_kernel(attr: str, name: str) -> Switch:
    """The model's kernel of one end of its sequence tower swapped for the kernel ``name``: ``pool_kernel``
    (``kernels.sequence_pool``: the final layer norm, the row gather and the membership-GEMM mean) or
    ``input_kernel`` (``kernels.sequence_input``: the add, the candidate's row moves, the position rows),
    gem-model's ``torch`` (those torch ops) or gem-kernels' ``triton`` (one pass over the rows each way)."""

    def apply(run: object) -> Callable[[], None]:
        from gem_kernels.sequence_input import TritonSequenceInput
        from gem_kernels.sequence_pool import TritonSequencePool
        from gem_model.model.sequence_input import TorchSequenceInput
        from gem_model.model.sequence_pool import TorchSequencePool

        kernels = {"pool_kernel": (TorchSequencePool, TritonSequencePool),
                   "input_kernel": (TorchSequenceInput, TritonSequenceInput)}[attr]  # fmt: skip
        model = run.model  # type: ignore[attr-defined]
        before = getattr(model, attr)
        setattr(model, attr, kernels[name == "triton"]())

        def undo() -> None:
            setattr(model, attr, before)

        return undo

    return apply


KERNEL_VARIANTS: dict[str, Switch] = {
    # the next-item loss by gem-model's torch kernel instead of the configured one (triton on the H200)
    "torch_loss": switch_torch_loss,
    "torch_sequence_pool": _tower_end_kernel("pool_kernel", "torch"),
    "triton_sequence_pool": _tower_end_kernel("pool_kernel", "triton"),
    "torch_sequence_input": _tower_end_kernel("input_kernel", "torch"),
    "triton_sequence_input": _tower_end_kernel("input_kernel", "triton"),
    # the norm-gate kernels and the gap's last backward pass as launched before their loads were pipelined
    # (2026-12-04): no tl.range stages, one forward tile a program, four backward programs per SM
    "pointwise_unpipelined": all_of(
        patched("gem_kernels.norm_gate_triton", "PIPELINE_STAGES", None),
        patched("gem_kernels.norm_gate_triton", "FORWARD_TILES", 1),
        patched("gem_kernels.norm_gate_triton", "BACKWARD_PROGRAMS_PER_SM", 4),
        patched("gem_kernels.hstu_gap_grad_rows", "PIPELINE_STAGES", None),
    ),
    # the forward's and the dq pass's key and value tiles by pointer loads, as before 2026-12-04 (tensor
    # descriptors since)
    "attention_pointer_loads": patched("gem_kernels.attention_triton_common", "TMA_LOADS", False),
    # the Gluon forward (attention_gluon: asynchronous wgmma, the next q k^T during the silu) where it applies
    "gluon_forward": patched("gem_kernels.attention_gluon", "FORWARD", True),
    "gluon_dq": patched("gem_kernels.attention_gluon", "DQ", True),  # the backward's dq pass in Gluon
    # the same at 32 keys a step and two programs an SM (the shipped dk/dv pass's shape), 3 or 2 stages
    **{f"gluon_dq_{config}": all_of(patched("gem_kernels.attention_gluon", "DQ", True),
                                    patched("gem_kernels.attention_gluon", "DEFAULT_DQ_CONFIG", config))
       for config in ("m64n32p2", "m64n32s2p2")},
    # the backward's dk/dv pass in Triton (the Gluon pass is shipped since 2026-12-05; this session's
    # commands named it ``gluon_dkdv``)
    "triton_dkdv": patched("gem_kernels.attention_gluon", "DKDV", False),
    "gluon_attention": all_of(patched("gem_kernels.attention_gluon", "FORWARD", True),
                              patched("gem_kernels.attention_gluon", "DQ", True),
                              patched("gem_kernels.attention_gluon", "DKDV", True)),
    # the bf16 uvqk GEMM in Triton with silu(v, q, k) in its epilogue, in place of cuBLAS and the silu pass
    "linear_silu": patched("gem_kernels.hstu_block", "LINEAR_SILU", True),
    # the bf16 out GEMM by cuBLAS and the residual added after it, as before 2026-12-06 (since then the
    # Triton GEMM with the residual in its epilogue; this switch was ``linear_residual``, turning it on)
    "residual_add": patched("gem_kernels.hstu_block", "LINEAR_RESIDUAL", False),
    # the shared negatives normalised, and their gradient taken back, by torch's seven float32 passes, as
    # before 2026-12-06 (one Triton pass each since; the switch was ``unit_rows_kernel``, turning it on)
    "torch_unit_rows": patched("gem_kernels.next_item_loss_triton", "UNIT_ROWS_KERNEL", False),
    # the bf16 out linears' bias gradients summed by the linears themselves, as before 2026-12-06 (since then by
    # the next block's layer norm backward as it writes their output gradient; the switch was
    # ``bias_sums_in_norm``, turning that on)
    # the u columns of the uvqk bias's gradient summed by the gap's last pass, which then reads them, as before
    # 2026-12-07 (since then by the norm-gate backward that writes them)
    "u_sums_in_grad_rows": patched("gem_kernels.hstu_gap_triton", "U_SUMS_IN_NORM_GATE", False),
    "bias_sums_in_linear": all_of(patched("gem_precision.bf16_linear", "BIAS_SUMS_FROM_PRODUCER", False),
                                  patched("gem_kernels.layer_norm_triton", "COLUMN_SUMS", False)),
}
