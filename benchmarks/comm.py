"""gem-comm's strategies: correctness against ``default`` and bytes per step; on 2 GPUs, contention.

CPU (gloo, ``--world`` processes, default 4 treated as 2 nodes of 2): every strategy trains the same
small MLP for ``--steps`` steps from the same start on the same data; the table gives the largest
parameter difference from ``default`` (checked against each strategy's stated tolerance) and the
dense bytes each rank sends per step, from the strategies' own exact counts. A second table
counts the embedding all-to-all's floating-point bytes of a torchrec-sharded table (2 ranks) in
fp32, bf16 and fp16 qcomms. A third gives the compute slowdown while all-reduces run
(``gem_comm.contention.compute_slowdown`` on 2 gloo ranks: CPU matmuls beside gloo's threads).

CUDA with 2 GPUs (``--contention``): issue 15's case. 12 bf16 8192^3 GEMMs on one stream and 4
all-reduces of 256 MB on another, alone and together, over the default NCCL group and over
``sm_free``'s group (the options path it took is printed). Needs NCCL; not run in CI.

    python benchmarks/comm.py --out-json /tmp/comm.json
    python benchmarks/comm.py --contention --out-json /tmp/comm_gpu.json   # 2 GPUs
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gem_comm.contention import compute_slowdown
from gem_comm.default import DefaultComm
from gem_comm.hierarchical import HierarchicalComm
from gem_comm.measure import CommMeter, count_all_to_all
from gem_comm.overlap import OverlapComm
from gem_comm.quantized import QuantizedComm
from gem_model.components import CommStrategy
from gem_model.distributed import DistEnv

TOLERANCE = {"default": 0.0, "overlap": 0.0, "hierarchical": 1e-6, "quantized": 5e-3}


def _strategies(node_size: int) -> dict[str, CommStrategy]:
    return {
        "default": DefaultComm(),
        "overlap": OverlapComm(OverlapComm.Config(bucket_cap_mb=0.25)),
        "quantized": QuantizedComm(),
        "hierarchical": HierarchicalComm(HierarchicalComm.Config(node_size=node_size)),
    }


def _dense(rank: int, world: int, steps: int, node_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))
    out = {}
    for name, comm in _strategies(node_size).items():
        comm.setup(DistEnv(rank, world, rank, torch.device("cpu"), "gloo"))
        ddp = nn.parallel.DistributedDataParallel(copy.deepcopy(base), **{"bucket_cap_mb": 0.25, **comm.ddp_kwargs()})
        comm.configure_ddp(ddp)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        for step in range(steps):
            gen = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(32, 64, generator=gen), torch.randn(32, 8, generator=gen)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        out[name] = {"params": [p.detach().clone() for p in ddp.parameters()], "measured": comm.measurements()}
    out["numel"] = sum(p.numel() for p in base.parameters())
    return out


def _embedding(rank: int, world: int) -> dict[str, float]:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import get_qcomm_codecs_registry
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        comm = QuantizedComm(QuantizedComm.Config(embedding_forward=precision, embedding_backward=precision))
        comm.setup(DistEnv(rank, world, rank, torch.device("cpu"), "gloo"))
        torch.manual_seed(0)
        tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=64, num_embeddings=1000, feature_names=[f"f{i}"]) for i in range(4)]
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.1})
        sharders = [EmbeddingBagCollectionSharder(qcomm_codecs_registry=get_qcomm_codecs_registry(comm.embedding_qcomms()))]
        cons = {t.name: ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"]) for t in tables}
        plan = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"), constraints=cons).collective_plan(
            ebc, sharders, dist.group.WORLD
        )
        model = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(dist.group.WORLD), device=torch.device("cpu"), plan=plan, sharders=sharders)
        gen = torch.Generator().manual_seed(rank)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=[f"f{i}" for i in range(4)], values=torch.randint(0, 1000, (4 * 64 * 3,), generator=gen), lengths=torch.full((4 * 64,), 3)
        )
        meter = CommMeter()
        with count_all_to_all(meter):
            model(kjt).values().sum().backward()
        out[precision] = meter.totals()["embedding.all_to_all.bytes"]
    return out


def _entry(rank: int, world: int, init: str, results: Any, job: str, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        if job == "slowdown":
            results[rank] = compute_slowdown(None, device=torch.device("cpu"))
        else:
            results[rank] = _dense(rank, world, *args) if job == "dense" else _embedding(rank, world)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(job: str, world: int, *args: Any) -> dict[int, Any]:
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_entry, args=(world, str(Path(tmp) / "init"), results, job, args), nprocs=world, join=True)
        return dict(results)


def cpu_checks(world: int, steps: int, node_size: int) -> dict[str, Any]:
    r = _spawn("dense", world, steps, node_size)[0]
    numel, rows, failed = r.pop("numel"), {}, []
    for name, res in r.items():
        diff = max(float((a - b).abs().max()) for a, b in zip(r["default"]["params"], res["params"], strict=True))
        if name == "default":  # measures nothing: its fp32 ring all-reduce, counted as overlap counts it
            per_step = 2 * (world - 1) * numel * 4 / world
        else:
            per_step = sum(v for k, v in res["measured"].items() if k.endswith(".bytes")) / steps
        ok = diff <= TOLERANCE[name]
        failed += [] if ok else [name]
        inter = sum(v for k, v in res["measured"].items() if ".inter." in k and k.endswith(".bytes")) / steps
        rows[name] = {
            "max_param_diff": diff, "tolerance": TOLERANCE[name], "ok": ok,
            "dense_bytes_per_step": per_step, "inter_node_bytes_per_step": inter if name == "hierarchical" else None,
        }  # fmt: skip
    emb = _spawn("embedding", 2)[0]
    print(f"dense: {numel} parameters, {world} gloo ranks as nodes of {node_size}, {steps} steps")
    print(f"{'strategy':<14}{'max |p - p_default|':>22}{'tolerance':>12}{'ok':>5}{'dense B/step/rank':>20}{'of which inter-node':>21}")
    for name, row in rows.items():
        inter = "-" if row["inter_node_bytes_per_step"] is None else f"{row['inter_node_bytes_per_step']:,.0f}"
        print(f"{name:<14}{row['max_param_diff']:>22.3g}{row['tolerance']:>12.1g}{'yes' if row['ok'] else 'NO':>5}{row['dense_bytes_per_step']:>20,.0f}{inter:>21}")
    print("\nembedding all-to-all, floating-point bytes per step (rank 0 of 2, 4 tables x 64 dims x 256 samples)")
    for precision, nbytes in emb.items():
        print(f"{precision:<6}{nbytes:>12,.0f}  ({emb['fp32'] / nbytes:.2f}x fewer than fp32)")
    slow = _spawn("slowdown", 2)
    print("\ncompute slowdown beside all-reduces (gem_comm.contention, gloo, 2 ranks, 256^2 matmuls, 4 MiB)")
    for rank, row in sorted(slow.items()):
        print(f"rank {rank}: alone {row['compute.alone.seconds'] * 1e3:.3f} ms, beside {int(row['comm.all_reduces'])} "
              f"all-reduces {row['compute.beside_comm.seconds'] * 1e3:.3f} ms: slowdown {row['compute.slowdown']:.2f}x")  # fmt: skip
    if failed:
        raise SystemExit(f"correctness check failed for {failed}")
    return {
        "dense": rows, "embedding_all_to_all_bytes": emb, "compute_slowdown": slow,
        "world": world, "node_size": node_size, "steps": steps,
    }  # fmt: skip


def _contention(rank: int, world: int, init: str, results: Any) -> None:
    from gem_comm.sm_free import SmFreeComm

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        bufs = [torch.randn(64 * 1024 * 1024, device="cuda") for _ in range(4)]  # 256 MB each
        sm = SmFreeComm()
        sm.setup(DistEnv(rank, world, rank, torch.device("cuda", rank), "nccl"))
        options, path = sm.nccl_options()
        groups = {"default": dist.group.WORLD, "sm_free": dist.new_group(list(range(world)), backend="nccl", pg_options=options)}
        compute, comm_stream = torch.cuda.Stream(), torch.cuda.Stream()

        def timed(gemm: bool, group: Any) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            dist.barrier()
            start.record()
            if group is not None:
                with torch.cuda.stream(comm_stream):
                    for b in bufs:
                        dist.all_reduce(b, group=group)
            if gemm:
                with torch.cuda.stream(compute):
                    for _ in range(12):
                        a @ a
            torch.cuda.synchronize()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        for _ in range(2):  # warm-up
            timed(True, groups["default"]), timed(True, groups["sm_free"])
        out: dict[str, Any] = {"gemm_alone_ms": timed(True, None), "sm_free_path": path}
        for name, group in groups.items():
            out[name] = {"comm_alone_ms": timed(False, group), "overlapped_ms": timed(True, group)}
        results[rank] = out
    finally:
        dist.destroy_process_group()


def gpu_contention() -> dict[str, Any]:
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
        raise SystemExit("--contention needs CUDA and 2 GPUs")
    with tempfile.TemporaryDirectory() as tmp, mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_contention, args=(2, str(Path(tmp) / "init"), results), nprocs=2, join=True)
        r = dict(results)[0]
    print(f"GEMMs alone {r['gemm_alone_ms']:.2f} ms; sm_free path {r['sm_free_path']}")
    for name in ("default", "sm_free"):
        row = r[name]
        target = 1.05 * max(r["gemm_alone_ms"], row["comm_alone_ms"])
        print(f"{name:<10} comm alone {row['comm_alone_ms']:.2f} ms, overlapped {row['overlapped_ms']:.2f} ms (target <= {target:.2f})")
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--node-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--contention", action="store_true", help="the 2-GPU GEMM / all-reduce case (CUDA only)")
    p.add_argument("--out-json", type=Path)
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, Any] = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
    }
    result["cpu"] = cpu_checks(a.world, a.steps, a.node_size)
    if a.contention:
        result["contention"] = gpu_contention()
    if a.out_json:
        a.out_json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
