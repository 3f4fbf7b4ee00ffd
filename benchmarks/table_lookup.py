"""The sequence table's lookup on its own: torchrec's fused TBE against a plain gather, fp32 and bf16 out.

Why: the big config's profile (``benchmarks/results/e2e_ab.md``) gives FBGEMM's
``split_embedding_nobag_codegen_forward_unweighted_kernel<float, float, float, ...>`` 11.1 ms a step,
for ~250k rows of 1024 floats (the histories, 128 negatives a sample, the candidates): ~2 GB read and
written, ~0.6 ms at the H200's copy rate. This measures the lookup in isolation, on the config's item
table (5M x 1024, fp32 for the big config) and the item ids of its step-1 batch (histories, negatives and
candidates, as the synthetic source draws them: Zipf-popular items), so the next step is chosen from figures:

* ``tbe``: torchrec's ``EmbeddingCollection`` sharded by ``DistributedModelParallel`` on one rank,
  the table optimizer fused into backward (the trainer's ``rowwise_adagrad`` spec), as ``torchrec_ddp``
  builds it; the lookup's output in float32 (what the run does today, then cast to bf16 by the model);
* ``tbe_bf16``: the same with FBGEMM writing bf16 (``fused_params={"output_dtype": SparseType.BF16}``),
  so no cast pass follows and the backward reads a bf16 gradient;
* ``gather``: ``torch.index_select`` of the same ids from a plain float32 tensor of the table's shape,
  then ``.bfloat16()``: the bandwidth-bound floor of the forward.
* ``tbe_even<M>``: ``tbe`` given the same ids re-split into ``M`` even bags per sample
  (``gem_model.model.lookup_bags``, the model's ``model.lookup_bags_per_sample``): FBGEMM's nobag kernel
  runs one warp per bag, so the batch's own bags (one per sample, up to 4,095 ids) leave most of the GPU
  idle. ``--bags`` names the values of ``M``.

Checked first, on fresh uniform tables: ``tbe_bf16``'s output equals ``tbe``'s rounded to bf16,
each ``tbe_even<M>``'s equals ``tbe``'s, and ``tbe``'s rows are finite and within the init bounds. Timed: forward alone, and forward plus
backward (the fused update included) for the TBE variants, interleaved over ``--rounds`` rounds after a
warm-up; medians and quartiles in ms; plus a profile of one TBE step naming its kernels.

    torchrun --standalone --nproc-per-node 1 benchmarks/table_lookup.py --out table_lookup.json   # H200
    torchrun --standalone --nproc-per-node 1 benchmarks/table_lookup.py -c configs/tiny.yaml --device cpu \\
        --rounds 2                                                                            # CPU smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from profiling import timed_ms  # benchmarks/profiling.py, beside this script

ITEM_FEATURES = ("seq_item", "neg_item", "cand_item")
"""The features the model looks up in its item table (gem_model.model.embeddings)."""


def item_ids(config_path: str, overrides: list[str]):
    """The config's item table size and width, and the item features of its step-1 global batch as a
    KeyedJaggedTensor, from the synthetic source the config names."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from gem_model.config_io import load_config
    from gem_model.data.synthetic import SyntheticConfig, SyntheticSource

    config = load_config(config_path, overrides)
    if config.data.source.name != "synthetic":
        raise SystemExit(f"{config_path}: data.source is {config.data.source.name!r}; this benchmark reads 'synthetic'")
    source = SyntheticSource(SyntheticConfig(**config.data.source.options))
    batch_size = config.data.global_batch_size
    features = source.make_batch(0, batch_size, torch.arange(batch_size)).sequence.to_dict()
    kjt = KeyedJaggedTensor.from_jt_dict({k: features[k] for k in ITEM_FEATURES})
    return source.config.num_items, config.model.embedding_dim, batch_size, kjt


def build(rows: int, dim: int, device: torch.device, bf16_out: bool, seed: int, bound: float):
    from torchrec import EmbeddingCollection, EmbeddingConfig
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from gem_model.config import TrainerConfig
    from gem_model.train.optim import sparse_optimizer_spec

    ec = EmbeddingCollection(
        tables=[EmbeddingConfig(name="item_table", embedding_dim=dim, num_embeddings=rows,
                                feature_names=list(ITEM_FEATURES),
                                weight_init_min=-bound, weight_init_max=bound)],
        device=torch.device("meta"),
    )
    fused_cls, fused_kwargs = sparse_optimizer_spec(TrainerConfig(sparse_lr=0.005)).fused()
    apply_optimizer_in_backward(fused_cls, list(ec.parameters()), fused_kwargs)
    fused_params = {}
    if bf16_out:
        from fbgemm_gpu.split_embedding_configs import SparseType

        fused_params = {"output_dtype": SparseType.BF16}
    sharder = EmbeddingCollectionSharder(fused_params=fused_params)
    hbm = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device=device.type, hbm_cap=hbm),
        constraints={"item_table": ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])},
    )
    plan = planner.collective_plan(ec, [sharder], dist.group.WORLD)  # type: ignore[arg-type]
    torch.manual_seed(seed)  # the tables are drawn on the device from this generator: the same for both
    return DistributedModelParallel(ec, env=ShardingEnv.from_process_group(dist.group.WORLD), device=device,
                                    plan=plan, sharders=[sharder])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", default="configs/h200-large.yaml", help="a config with a synthetic source")
    p.add_argument("--set", action="append", default=[], help="a config override (key=value)")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--bags", default="8,32,128", help="bags per sample of the tbe_even variants (comma-separated)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    from gem_model.model.embeddings import table_bound
    from gem_model.model.lookup_bags import even_bags

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rows, dim, batch_size, kjt = item_ids(args.config, args.set)
    ids = kjt.values()
    kjt, ids_dev = kjt.to(device), ids.to(device)
    bound = table_bound(rows)
    print(f"{batch_size} samples, {ids.numel():,} rows of {dim} looked up from {rows:,}", flush=True)

    # FBGEMM's CPU nobag kernel has no bf16 output ("not implemented for 'BFloat16'"): tbe_bf16 is GPU only
    bf16 = device.type == "cuda"
    models = {"tbe": build(rows, dim, device, False, args.seed, bound)}
    if bf16:
        models["tbe_bf16"] = build(rows, dim, device, True, args.seed, bound)
    plain = torch.empty(rows, dim, device=device).uniform_(-bound, bound)
    grad = torch.randn(ids.numel(), dim, device=device, generator=torch.Generator(device).manual_seed(3))

    inputs = {name: kjt for name in models}
    for m in [int(x) for x in args.bags.split(",") if x]:
        models[f"tbe_even{m}"] = models["tbe"]  # the same table, given the ids in even bags
        inputs[f"tbe_even{m}"] = even_bags(kjt, m)

    def looked_up(name: str) -> list[torch.Tensor]:  # each feature's rows, in the KJT's order (as ids)
        return [jt.values() for jt in models[name](inputs[name]).wait().values()]

    grads = grad.to(torch.bfloat16).split([int(n) for n in kjt.length_per_key()])  # the model's bf16 gradients

    with torch.no_grad():
        out32 = torch.cat(looked_up("tbe"))
        out16 = torch.cat(looked_up("tbe_bf16")) if bf16 else None
    checks: dict[str, object] = {
        "tbe_dtype": str(out32.dtype),
        "tbe_finite_in_bounds": bool(torch.isfinite(out32).all() and out32.abs().max() <= bound * (1 + 1e-6)),
        # two different ids give two different rows (ids repeat: popular items recur)
        "rows_not_all_equal": bool((out32[0] != out32[int((ids != ids[0]).nonzero()[0])]).any()),
    }
    if out16 is not None:
        checks |= {"tbe_bf16_dtype": str(out16.dtype),
                   "tbe_bf16_equals_tbe_rounded": bool(torch.equal(out16, out32.bfloat16()))}  # fmt: skip
    with torch.no_grad():
        for name in [n for n in inputs if n.startswith("tbe_even")]:
            checks[f"{name}_equals_tbe"] = bool(torch.equal(torch.cat(looked_up(name)), out32))
    print("checks:", checks, flush=True)
    if not all(v for k, v in checks.items() if not k.endswith("dtype")):
        print("a check failed: nothing timed", file=sys.stderr)
        return 1

    def forward(name: str) -> Callable[[], object]:
        def run() -> object:
            with torch.no_grad():
                return [v.bfloat16() for v in looked_up(name)]  # the model casts each to bf16
        return run

    def train(name: str) -> Callable[[], object]:
        def run() -> None:
            torch.autograd.backward([v.bfloat16() for v in looked_up(name)], list(grads))
        return run

    cases = {f"forward {name}": forward(name) for name in models}
    cases["forward gather"] = lambda: plain.index_select(0, ids_dev).bfloat16()
    cases |= {f"fwd+bwd {name}": train(name) for name in models}
    for fn in cases.values():  # warm-up
        timed_ms(fn, device)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(args.rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for k in order:
            times[k].append(timed_ms(cases[k], device))
    moved = ids.numel() * dim * (4 + 2)  # fp32 rows read, bf16 rows written
    rows = []
    print(f"\n{'case':<18} {'q1 ms':>8} {'median':>8} {'q3 ms':>8} {'GB/s (rows read fp32 + bf16 written)':>38}")
    for k, ts in times.items():
        q = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) > 1 else [ts[0]] * 3
        med = statistics.median(ts)
        rows.append({"case": k, "q1_ms": q[0], "median_ms": med, "q3_ms": q[2], "times_ms": ts})
        print(f"{k:<18} {q[0]:8.3f} {med:8.3f} {q[2]:8.3f} {moved / med / 1e6:38.0f}")

    kernels: list[dict] = []
    if device.type == "cuda":
        from profiling import device_events, top_kernels  # benchmarks/profiling.py, beside this script

        for name in ["tbe", *[n for n in inputs if n.startswith("tbe_even")][:1]]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                train(name)()
                torch.cuda.synchronize()
            top = top_kernels(device_events(prof), 1, 12)
            kernels += [{"variant": name, **kv} for kv in top]
            print(f"\none fwd+bwd of {name}, by kernel:")
            for kv in top:
                print(f"  {kv['ms_per_step']:8.3f} ms  {kv['kernel'][:110]}")
    if args.out:
        meta = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes"),
                "command": " ".join(sys.argv),
                "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                "torch": torch.__version__, "rows_looked_up": ids.numel(), **vars(args)}  # fmt: skip
        result = {"meta": meta, "checks": checks, "rows": rows, "kernels": kernels}
        Path(args.out).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
