"""Walks precision scheme x overrides x min_dim x activation policy for one attention kernel on a
tiny model, two CPU training steps each, and prints one JSON line per combination.

Run by ``test_precision_matrix.py`` in a subprocess per kernel, and for Triton per scheme (the
Triton half needs ``TRITON_INTERPRET=1`` set before triton is imported, which must not leak into
other tests; its interpreter takes about 0.4 s of CPU per combination, so each scheme is a test):

    python tests/precision_matrix.py torch [SCHEME ...]
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import tempfile

import torch

from gem_model.config_io import load_config
from gem_model.distributed import init_distributed, teardown
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components
from gem_model.train.run import Run

SCHEMES = ["fp32", "bf16", "fp8_tensorwise", "fp8_rowwise", "mxfp8"]
OVERRIDES: dict[str, dict[str, str]] = {"none": {}, "task_head_fp32": {"task_head.*": "fp32"}}
MIN_DIMS = [0, 16]
POLICIES = ["none", "checkpoint_full", "checkpoint_selective", "fp8_saved"]
TINY = [
    "model.embedding_dim=32",
    "model.num_blocks=1",
    "model.num_heads=1",  # the interpreted Triton kernels' time grows with heads x sequences
    "model.attention_dim=16",
    "model.value_dim=16",
    "model.max_seq_len=8",
    "model.mlp_hidden=32",
    "data.source.options.max_len=7",
    "data.source.options.num_negatives=4",
    "data.source.options.num_dense=8",
    "data.global_batch_size=2",
    "trainer.steps=2",
    "trainer.log_every=1",
    "trainer.progress=false",
    "trainer.checkpoint_at_end=false",
    "trainer.eval_at_end=false",
]


def record_dtypes(model: torch.nn.Module) -> dict[str, set[str]]:
    """The dtypes that reach each kind of op: the blocks, their attention and linears, the norms."""
    seen: dict[str, set[str]] = {}

    def note(kind: str):
        def hook(module, args, *rest):
            for a in args:
                if isinstance(a, torch.Tensor) and a.is_floating_point():
                    seen.setdefault(kind, set()).add(str(a.dtype).removeprefix("torch."))
                    break

        return hook

    for fqn, module in model.named_modules():
        if fqn.startswith("sparse."):
            continue
        if isinstance(module, torch.nn.Linear) or hasattr(module, "in_features"):
            module.register_forward_pre_hook(note("linear_in"))
            module.register_forward_hook(lambda m, a, out: seen.setdefault("linear_out", set()).add(str(out.dtype)[6:]))
        elif isinstance(module, torch.nn.LayerNorm):
            module.register_forward_pre_hook(note("norm_in"))
    for block in getattr(model, "blocks", []):
        block.attention = _Spy(block.attention, seen)
    return seen


class _Spy:
    """The block's attention kernel, recording the dtype of what it sees; its fused block (when it offers
    one) records the dtype of the uvqk projection's output, silu of which is what its attention sees."""

    def __init__(self, inner, seen):
        self.inner, self.seen = inner, seen
        # what its fused block stores saved activations in: fp8_saved then compresses in the kernels
        self.saved_formats = getattr(inner, "saved_formats", ())

    def __call__(self, q, *args, **kwargs):
        self.seen.setdefault("attention_in", set()).add(str(q.dtype)[6:])
        return self.inner(q, *args, **kwargs)

    def fused_block(self, norm_gate):
        make = getattr(self.inner, "fused_block", None)
        block = make(norm_gate) if make is not None else None
        if block is None:
            return None

        def spied(x, uvqk, *args, **kwargs):
            def projected(t):
                pre = uvqk(t)
                self.seen.setdefault("attention_in", set()).add(str(pre.dtype)[6:])
                return pre

            return block(x, projected, *args, **kwargs)

        return spied


def run_one(kernel: str, scheme: str, overrides: str, min_dim: int, policy: str, out_dir: str) -> dict:
    args = [
        *TINY,
        f"kernels.jagged_attention={kernel}",
        f"kernels.norm_gate={kernel}",
        f"precision.scheme={scheme}",
        f"precision.min_dim={min_dim}",
        f"activation.policy={policy}",
        f"trainer.output_dir={out_dir}/{scheme}-{overrides}-{min_dim}-{policy}",
    ]
    config = load_config(None, args).model_copy(deep=True)
    config.precision.overrides.update(OVERRIDES[overrides])
    case = {"kernel": kernel, "scheme": scheme, "overrides": overrides, "min_dim": min_dim, "policy": policy}
    pm = GemPluginManager()
    env = None
    try:
        components = resolve_components(config, pm)
        env = init_distributed("cpu")
        run = Run(config, pm, components, env)
    except Exception as exc:  # refused before training: the message is the product
        return {**case, "outcome": "refused", "error": f"{type(exc).__name__}: {exc}"}
    seen = record_dtypes(run.model)
    try:
        summary = run.fit()
    finally:
        teardown(env, clean=True)
    return {
        **case,
        "outcome": "trained" if math.isfinite(summary.last_loss) else "nonfinite",
        "first_loss": summary.first_loss,
        "last_loss": summary.last_loss,
        "activation_dtype": str(run.preparation.precision.activation_dtype)[6:],
        "dtypes": {k: sorted(v) for k, v in seen.items()},
        # forwards whose blocks compressed what they save in their own kernels (fp8_saved on the fused block)
        "kernel_forwards": getattr(getattr(components.activation[policy], "stats", None), "kernel_forwards", 0),
    }


def main(kernel: str, schemes: list[str]) -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out_dir:
        for scheme, overrides, min_dim, policy in itertools.product(schemes, OVERRIDES, MIN_DIMS, POLICIES):
            print("MATRIX", json.dumps(run_one(kernel, scheme, overrides, min_dim, policy, out_dir)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or SCHEMES)
