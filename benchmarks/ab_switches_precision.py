"""The precision switches of ``benchmarks/e2e_ab.py`` (:mod:`ab_switches` has the others and the contract):
the model's bf16 linears swapped for an fp8 scheme's, ``fp8_saved`` on the live blocks, and the fp8
paths before each of their fused producers.
"""

from __future__ import annotations

from collections.abc import Callable

from ab_patch import Switch, patched  # beside this script


def _precision(scheme_name: str, **options: object) -> Switch:
    """The model's bf16 linears swapped for ``scheme_name``'s modules (``fp8_rowwise``, ...), built by the
    registered scheme from the same Parameters, so the optimizer and the weights are shared; the swap
    is undone by putting the bf16 modules back. The converted modules are kept across toggles."""

    def apply(run: object) -> Callable[[], None]:
        from gem_model.plugins import GemPluginManager

        cache = run.__dict__.setdefault("_ab_precision", {})  # type: ignore[attr-defined]
        key = (scheme_name, tuple(sorted(options.items())))
        if key not in cache:
            entry = GemPluginManager().precision_schemes.get(scheme_name)
            scheme = entry.cls(entry.cls.Config(**options))
            swaps = []
            for parent_name, parent in run.model.named_modules():  # type: ignore[attr-defined]
                for child_name, child in parent.named_children():
                    if type(child).__name__ == "Bf16Linear":
                        fqn = f"{parent_name}.{child_name}".lstrip(".")
                        swaps.append((parent, child_name, child, scheme.convert_linear(child, fqn)))
            if not swaps:
                raise SystemExit(f"--variants {scheme_name}: the run has no bf16 linears to convert (precision.scheme bf16)")
            cache[key] = swaps
        swaps = cache[key]
        for parent, name, _, new in swaps:
            setattr(parent, name, new)

        def undo() -> None:
            for parent, name, old, _ in swaps:
                setattr(parent, name, old)

        return undo

    return apply


def _fp8_saved(*, in_kernels: bool) -> Switch:
    """A switch for ``benchmarks/e2e_ab.py``: ``fp8_saved`` (``in_kernels`` as given) on the live run's
    HSTU blocks, as the trainer applies it; its undo gives the blocks back their own forward. The run
    itself must be configured with ``activation.policy: none``."""

    def apply(run: object) -> Callable[[], None]:
        from gem_precision.activation import POLICY_ATTR, Fp8SavedPolicy

        blocks = list(run.model.blocks)  # type: ignore[attr-defined]
        policy = Fp8SavedPolicy(Fp8SavedPolicy.Config(in_kernels=in_kernels))
        for i, block in enumerate(blocks):
            policy.wrap_block(block, f"blocks.{i}")

        def undo() -> None:
            for block in blocks:
                del block.forward  # the instance attribute the policy set: the class's forward again
                delattr(block, POLICY_ATTR)
                block.saved_format = None

        return undo

    return apply


def switch_fp8_own_grad_rows(run: object) -> Callable[[], None]:
    """fp8_rowwise's linears quantize their output gradient themselves (one-pass rows), as before the
    fused gap offered the ``uvqk`` gradient's rows (``ScaledLinear.grad_rows_slot`` makes no slot)."""
    from gem_precision.scaled_linear import ScaledLinear

    before = ScaledLinear.grad_rows_slot
    ScaledLinear.grad_rows_slot = lambda self, device: None  # type: ignore[method-assign]

    def undo() -> None:
        ScaledLinear.grad_rows_slot = before  # type: ignore[method-assign]

    return undo


PRECISION_VARIANTS: dict[str, Switch] = {
    # the bf16 linears' (and fp8_rowwise's bf16 weight GEMM's) gradients computed in bf16 and cast to
    # float32 in launches of their own, as before gem_precision.bf16_linear wrote them in float32
    "bf16_grads_cast": patched("gem_precision.bf16_linear", "FLOAT32_GRADS", False),
    # the bf16 linears read their weight and bias from the scheme's shared cast cache (one foreach copy a step)
    "cast_once": patched("gem_precision.bf16_linear", "CAST_ONCE", True),
    # fp8_rowwise as configured by default (since 3bf6661: weight_gradient bf16, producer_quantization on)
    "fp8_rowwise": _precision("fp8_rowwise"),
    "fp8_tensorwise": _precision("fp8_tensorwise"),
    # each combination of fp8_rowwise's two options, named explicitly (the results name these switches)
    "fp8_rowwise_fp8_dw": _precision("fp8_rowwise", weight_gradient="fp8", producer_quantization=False),
    "fp8_rowwise_producers": _precision("fp8_rowwise", weight_gradient="fp8", producer_quantization=True),
    "fp8_rowwise_gw_bf16": _precision("fp8_rowwise", weight_gradient="bf16", producer_quantization=False),
    "fp8_rowwise_gw_bf16_producers": _precision("fp8_rowwise", weight_gradient="bf16", producer_quantization=True),
    # the weight gradient as an e4m3 GEMM with 1 x 128 block scales, its operands made in backward from the
    # bf16 g and saved x (gem_precision.blockwise_weight_grad); the forward and dx as the default's
    "fp8_rowwise_dw_blocks": _precision("fp8_rowwise", weight_gradient="fp8_blocks", producer_quantization=True),
    # row-scaled fp8 alone through the stats and cast passes, as before the one-pass kernel
    "fp8_two_pass_rows": patched("gem_precision.fp8_rows_triton", "ONE_PASS_MAX_N", 0),
    "fp8_own_grad_rows": switch_fp8_own_grad_rows,
    # only the gap offers gradient rows (to uvqk); each block's out quantizes its own output gradient, as
    # the layer norm backward offers it nothing (hstu_block.attached_grad_rows -> None)
    "fp8_gap_grad_rows_only": patched("gem_kernels.hstu_block", "attached_grad_rows", lambda t: None),
    "fp8_saved": _fp8_saved(in_kernels=True),
    "fp8_saved_hooks": _fp8_saved(in_kernels=False),
    # with fp8_saved: the attention output kept as computed, as before 2026-12-04 19:30 UTC (its e4m3 rows since)
    "fp8_saved_attn_as_computed": patched("gem_kernels.hstu_gap_triton", "SAVED_ATTENTION_E4M3", False),
    # with fp8_saved: passes expand the gate's and the attention output's e4m3 rows before the norm-gate
    # backward, as before 2026-12-04 21:30 UTC (since, that backward reads them in its loop as 16-bit words)
    "fp8_saved_rows_expanded": patched("gem_kernels.hstu_gap_triton", "E4M3_ROWS_IN_NORM_GATE", False),
    # the norm-gate forward storing its e4m3 rows (fp8_rowwise's of y, fp8_saved's of x) as bytes, as before
    # 2026-12-04 21:30 UTC (since, as 16-bit words, which keep its tile's layout)
    "fp8_byte_stores": patched("gem_kernels.norm_gate_triton", "E4M3_WORD_STORES", False),
}
