"""The switches of ``benchmarks/e2e_ab.py``: each is applied to a live run between two steps and returns
the function that undoes it, so that every variant of an A/B trains the same model on the same batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from ab_patch import Switch, all_of, patched  # beside this script
from ab_switches_kernels import KERNEL_VARIANTS  # beside this script
from ab_switches_precision import PRECISION_VARIANTS  # beside this script
from torch.nn.attention import SDPBackend


def _blocks(run: object) -> list[torch.nn.Module]:
    return list(run.model.blocks)  # type: ignore[attr-defined]


def switch_base(run: object) -> Callable[[], None]:
    return lambda: None


def switch_compile(run: object) -> Callable[[], None]:
    """``torch.compile`` of each HSTU block, as ``trainer.compile`` does (``nn.Module.compile``); the
    compiled callable is kept and swapped in and out, so the variant compiles once."""
    blocks = _blocks(run)
    for b in blocks:
        if getattr(b, "_ab_compiled", None) is None:
            b.compile()
            b._ab_compiled = b._compiled_call_impl
        b._compiled_call_impl = b._ab_compiled

    def undo() -> None:
        for b in blocks:
            b._compiled_call_impl = None

    return undo


def _attention_option(**options: object) -> Switch:
    def apply(run: object) -> Callable[[], None]:
        kernel = run.components.attention  # type: ignore[attr-defined]
        before = kernel.config
        kernel.config = before.model_copy(update=options)

        def undo() -> None:
            kernel.config = before

        return undo

    return apply


def switch_unfused(run: object) -> Callable[[], None]:
    """The HSTU blocks op by op (layer norm, residual add, silu, split, attention, norm-gate) instead of fused."""
    blocks = _blocks(run)
    for b in blocks:
        b.fuse = False

    def undo() -> None:
        for b in blocks:
            b.fuse = True

    return undo


def switch_host_syncs(run: object) -> Callable[[], None]:
    """The batches without their host-side lengths: the model then reads lengths back from the device
    (the candidate check, the next-item plan), as before ``Batch.host_lengths`` existed."""
    batches = run._ab_batches  # type: ignore[attr-defined]
    saved = [b.host_lengths for b in batches]
    for b in batches:
        b.host_lengths = None

    def undo() -> None:
        for b, h in zip(batches, saved):
            b.host_lengths = h

    return undo


def switch_adamw_foreach(run: object) -> Callable[[], None]:
    """The dense AdamW in torch's ``foreach`` implementation instead of the run's (fused on a GPU:
    ``gem_model.train.dense_optimizer``). Both optimizers hold the same moment tensors; only the
    step count lives apart (a GPU tensor when fused, a host one for foreach) and is carried over."""
    optimizers = run.optimizers  # type: ignore[attr-defined]
    own = optimizers.dense
    other = run.__dict__.get("_ab_foreach")  # type: ignore[attr-defined]
    if other is None:
        group = own.param_groups[0]
        other = torch.optim.AdamW(group["params"], lr=group["lr"], betas=group["betas"],
                                  weight_decay=group["weight_decay"], foreach=True)  # fmt: skip
        run.__dict__["_ab_foreach"] = other  # type: ignore[attr-defined]

    def carry(src: torch.optim.Optimizer, dst: torch.optim.Optimizer, *, on_device: bool) -> None:
        dst.param_groups[0]["lr"] = src.param_groups[0]["lr"]
        for p in src.param_groups[0]["params"]:
            state = src.state.get(p)
            if not state:
                continue
            step = float(state["step"])
            dst.state[p] = {
                "step": torch.tensor(step, dtype=torch.float32, device=p.device if on_device else "cpu"),
                "exp_avg": state["exp_avg"],
                "exp_avg_sq": state["exp_avg_sq"],
            }

    carry(own, other, on_device=False)
    optimizers.dense = other

    def undo() -> None:
        carry(other, own, on_device=bool(own.param_groups[0].get("fused")))
        optimizers.dense = own

    return undo


def switch_whole_bags(run: object) -> Callable[[], None]:
    """The sequence lookup in the batch's own bags (one per sample and feature) instead of the even bags
    of ``model.lookup_bags_per_sample`` (``gem_model.model.lookup_bags``)."""
    sparse = run.model.sparse  # type: ignore[attr-defined]
    before = sparse.lookup_bags_per_sample
    sparse.lookup_bags_per_sample = None

    def undo() -> None:
        sparse.lookup_bags_per_sample = before

    return undo


def sequence_tbes(run: object) -> list[torch.nn.Module]:
    """The FBGEMM table modules of the run's sharded sequence lookup (``model.sparse.ec``). torchrec keeps
    them under the sharded module's ``_lookups``, which ``named_modules`` does not list."""
    ec = run.model.sparse.ec  # type: ignore[attr-defined]
    return [m for lookup in getattr(ec, "_lookups", []) for m in lookup.modules()
            if hasattr(m, "output_dtype") and hasattr(m, "weights_dev")]  # fmt: skip


def _lookup_dtype(name: str, dtype: str) -> Switch:
    """FBGEMM's sequence lookup writes ``dtype`` (its ``output_dtype``, flipped on the live
    TBE modules; what ``parallel.planner.options.table_output_dtype`` builds). Measures what
    ``benchmarks/results/table_lookup.md`` leaves open: the lookup's 16-bit output, and the model's casts and
    float32 adds after it. ``bfloat16`` on a GPU only: FBGEMM's CPU nobag kernel has none (``float16`` runs
    there, for the tests)."""

    def apply(run: object) -> Callable[[], None]:
        from gem_parallel.sharded import SPARSE_TYPES

        tbes = sequence_tbes(run)
        if not tbes:
            raise SystemExit(f"--variants {name}: the run has no FBGEMM table modules (a torchrec planner shards them)")
        if dtype == "bfloat16" and run.env.device.type != "cuda":  # type: ignore[attr-defined]
            raise SystemExit(f"--variants {name}: FBGEMM writes bf16 lookups on a GPU only")
        before = [m.output_dtype for m in tbes]
        for m in tbes:
            m.output_dtype = SPARSE_TYPES[dtype].as_int()

        def undo() -> None:
            for m, was in zip(tbes, before, strict=True):
                m.output_dtype = was

        return undo

    return apply


def _loss_plan(*, growth: float, small: int, chunk_elements: int) -> Switch:
    """The next-item loss's shared-negative plan with coarser buckets and bigger chunks
    (``gem_model.model.next_item_plan``'s constants, read at call time): fewer chunks, so fewer small
    kernels for the host to launch in the loss's backward (where the device waits for it), for more
    padded slots."""

    def apply(run: object) -> Callable[[], None]:
        from gem_model.model import next_item_plan as plan

        before = plan.BUCKET_GROWTH, plan.SMALL_BUCKET, plan.CHUNK_ELEMENTS
        plan.BUCKET_GROWTH, plan.SMALL_BUCKET, plan.CHUNK_ELEMENTS = growth, small, chunk_elements

        def undo() -> None:
            plan.BUCKET_GROWTH, plan.SMALL_BUCKET, plan.CHUNK_ELEMENTS = before

        return undo

    return apply


def switch_backward_on_main_thread(run: object) -> Callable[[], None]:
    """Backward on the thread that calls it (``torch.autograd.set_multithreading_enabled(False)``)
    instead of autograd's device thread: whether handing the graph to that thread is what leaves the
    device idle for ~2 ms at the backward's start (the host inside the first ``MulBackward0``'s
    ``aten::mul`` in the profiles, right after the step's one sync). The old mode is put back on undo."""
    before = torch._C._is_multithreading_enabled()
    torch._C._set_multithreading_enabled(False)
    return lambda: torch._C._set_multithreading_enabled(before)


def _insert_one_before(values: torch.Tensor, lengths: torch.Tensor, extra: torch.Tensor, *, at_start: bool = False):
    """``gem_model.jagged.insert_one`` as it was before 2026-12-04: a zero fill and two out-of-place
    ``index_copy`` (each a copy of the whole output), undone by autograd's own backward."""
    from gem_model.jagged import offsets_of, sequence_ids

    new_lengths = lengths + 1
    new_offsets = offsets_of(new_lengths)
    shift = sequence_ids(lengths, values.shape[0]) + (1 if at_start else 0)
    hist_index = torch.arange(values.shape[0], device=values.device) + shift
    extra_index = new_offsets[:-1] if at_start else new_offsets[1:] - 1
    out = values.new_zeros((values.shape[0] + lengths.numel(), *values.shape[1:]))
    out = out.index_copy(0, hist_index, values)
    return out.index_copy(0, extra_index, extra.to(values.dtype)), new_lengths


def switch_ddp_no_sync(run: object) -> Callable[[], None]:
    """DDP's gradient hooks off (``require_backward_grad_sync = False``, what ``no_sync()`` sets for a
    step). With one rank the all-reduce changes no value, but the reducer still copies and scales every
    gradient into its buckets, one launch per parameter (81 a step on the big config, 1.2 ms of device
    idle under the profiler, 2026-12-04): this measures what leaving DDP out at one rank would save.
    Refused when the run has no DDP module or more than one rank (the gradients would go unsynchronised)."""
    prepared = getattr(run, "prepared", None)  # the planner's module (torchrec's DMP holds the DDP), else the model
    root = prepared.module if prepared is not None else run.model  # type: ignore[attr-defined]
    ddps = [m for m in root.modules() if isinstance(m, torch.nn.parallel.DistributedDataParallel)]
    if not ddps:
        raise ValueError("ddp_no_sync: the run has no DistributedDataParallel module (its planner does not use DDP)")
    ranks = {torch.distributed.get_world_size(d.process_group) for d in ddps}
    if ranks != {1}:
        raise ValueError(f"ddp_no_sync: DDP over {sorted(ranks)} ranks; the switch is for one rank only")
    before = [d.require_backward_grad_sync for d in ddps]
    for d in ddps:
        d.require_backward_grad_sync = False

    def undo() -> None:
        for d, flag in zip(ddps, before, strict=True):
            d.require_backward_grad_sync = flag

    return undo


def switch_recat_cache(run: object) -> Callable[[], None]:
    """torchrec's input-distribution feature permutation made once per shape
    (``gem_parallel.recat_cache``, what ``parallel.planner.options.cache_recat`` installs): two host syncs
    a step fewer in the big config's forward. Refused if the cache is already in (the run's own option:
    the A rows would not be without it)."""
    from gem_parallel import recat_cache

    if recat_cache.installed():
        raise ValueError("recat_cache: the cache is already installed (parallel.planner.options.cache_recat is on)")
    return recat_cache.install()


def switch_no_recat_cache(run: object) -> Callable[[], None]:
    """The run without the recat cache that ``parallel.planner.options.cache_recat`` installs by default
    (torchrec's own permutation, made every forward); undone, the cache goes back in. Refused where none
    is installed (the A rows are then without it already)."""
    from gem_parallel import recat_cache

    if not recat_cache.installed():
        raise ValueError("no_recat_cache: no recat cache is installed (parallel.planner.options.cache_recat is off)")
    return recat_cache.uninstall()


def _loss_read(at_tables: bool) -> Switch:
    """Where the step reads its loss sums: inside backward at the tables' gate, the loss built on the
    device (``at_tables``: ``trainer.loss_check=before_tables``, :mod:`gem_model.train.loss_check`), or
    by the host between forward and backward (``before_backward``, the default until 2026-12-05).
    Refused where the run already reads it there, or, for the tables, where its layout or
    ``trainer.non_finite`` cannot (the step's own check)."""
    name, where = ("loss_at_tables", "at the tables") if at_tables else ("loss_before_backward", "before backward")

    def apply(run: object) -> Callable[[], None]:
        from gem_model.train.loss_check import check_in_backward

        step = run.core_step  # type: ignore[attr-defined]
        if step.in_backward == at_tables:
            raise ValueError(f"{name}: the run already reads its loss {where} (trainer.loss_check)")
        trainer = step.config.trainer.model_copy(update={"loss_check": "before_tables"})
        if at_tables and not check_in_backward(trainer, step.layout):
            raise ValueError(f"{name}: trainer.non_finite={trainer.non_finite} needs the loss before backward")
        step.in_backward = at_tables

        def undo() -> None:
            step.in_backward = not at_tables

        return undo

    return apply


VARIANTS: dict[str, Switch] = {
    "base": switch_base,
    "compile": switch_compile,
    "dq_atomic": _attention_option(dq="atomic"),
    "dq_separate": _attention_option(dq="separate"),
    "dq_stored": _attention_option(dq="stored"),
    "unfused": switch_unfused,
    "adamw_foreach": switch_adamw_foreach,
    "fp8_attention": _attention_option(fp8_forward=True),
    # the uvqk bias gradient by the linear's own reduction (bias_grad_in_gap off; on by default since 2026-12-04)
    "bias_grad_by_linear": _attention_option(bias_grad_in_gap=False),
    "host_syncs": switch_host_syncs,
    # the history's mean by index_add of float32 copies (before ca34568) instead of the membership GEMM
    "index_add_mean": patched("gem_model.jagged", "MEMBERSHIP_GEMM_ELEMENTS", 0),
    # the even bags' per-key counts by a pageable copy (before b184563) instead of gem_model.host_copy's
    "pageable_bags": patched("gem_model.model.lookup_bags", "to_device_async", lambda host, device: host.to(device)),
    "whole_bags": switch_whole_bags,
    "bf16_lookup": _lookup_dtype("bf16_lookup", "bfloat16"),
    "fp16_lookup": _lookup_dtype("fp16_lookup", "float16"),  # the same on the CPU (FBGEMM has no bf16 there)
    # float32 lookups, as configs/h200-large.yaml ran until 2026-12-05 (table_output_dtype: bfloat16 since)
    "f32_lookup": _lookup_dtype("f32_lookup", "float32"),
    "loss_buckets_1.5": _loss_plan(growth=1.5, small=128, chunk_elements=1 << 26),
    "loss_buckets_2": _loss_plan(growth=2.0, small=128, chunk_elements=1 << 27),
    # backward on the training thread instead of autograd's device thread
    "backward_on_main_thread": switch_backward_on_main_thread,
    "ddp_no_sync": switch_ddp_no_sync,
    # the sequence's rows moved as before 2026-12-04: the candidate appended by a zero fill and two
    # out-of-place copies, the position rows gathered in float32 and cast in a pass of their own, and the
    # output's history and candidate rows taken by indexing (whose backward fills zeros, scatters with
    # accumulation and adds the two gradients)
    "sequence_rows_as_before": all_of(
        patched("gem_model.jagged", "insert_one", _insert_one_before),
        patched("gem_model.model.sequence_input", "position_rows",
                lambda table, positions, dtype: torch.nn.functional.embedding(positions, table).to(dtype)),
        patched("gem_model.model.sequence_pool", "split_rows", lambda x, index_a, index_b: (x[index_a], x[index_b])),
    ),
    # torchrec's input-distribution permutation made once per shape (no host sync in the forward)
    "recat_cache": switch_recat_cache,
    # the same runs without it (the default since 2026-12-05 18:22 UTC: parallel.planner.options.cache_recat)
    "no_recat_cache": switch_no_recat_cache,
    # the loss read inside backward at the tables' gate (no host sync between forward and backward)
    "loss_at_tables": _loss_read(at_tables=True),
    # the loss read by the host between forward and backward (the default until 2026-12-05)
    "loss_before_backward": _loss_read(at_tables=False),
    # the rows of the candidate insertion and the output split moved element by element (2 bytes in bf16)
    "rows_by_element": patched("gem_model.jagged", "_as_words", lambda t: t),
    # the bf16 linears' bias gradients by torch's reduction, as before 2026-12-06 (one Triton pass since; the
    # switch was ``bias_grad_kernel``, turning it on; measured with ab_switches_kernels' ``torch_unit_rows``)
    "torch_bias_grad": patched("gem_precision.bf16_linear", "BIAS_GRAD_KERNEL", False),
    # the sequence lookup's gradients by feature, as before 2026-12-07: autograd's split backward concatenates
    # them and adds the items' two (gem_model.table_grad's one buffer, which the Triton kernels write, is shipped)
    "table_grads_by_feature": patched("gem_model.model.embeddings", "ONE_GRADIENT_BUFFER", False),
    # the token mixers' attention on flash, memory-efficient or math SDPA, not torch's choice (cuDNN on Hopper)
    "mixer_no_cudnn": patched("gem_model.model.hstu", "MIXER_SDPA_BACKENDS", [
        SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]),
    **KERNEL_VARIANTS,
    **PRECISION_VARIANTS,
}
