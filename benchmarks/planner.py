"""The topology-aware planner and the ``seq_balanced`` balancer on the CPU (no GPU, no process group).

Planner: a GEM-sized model (24 HSTU blocks of width 2048, 1.1B dense parameters; an item table of
2B rows x 256 and 24 feature tables of 200M x 128, 1.13T table parameters, fp32 with row-wise
Adagrad: 4.5 TB) with Zipf(1.2) sequence lengths up to 4096 and 32 samples per GPU, planned by
:func:`gem_parallel.topology_planner.plan_topology` for simulated H200 clusters (NVLink 450 GB/s,
one 400 Gb/s NIC per GPU, 141 GB HBM). Each row: the degrees and mesh order chosen, which
dimensions sit on NVLink, the estimated comm time per step against the naive order (the
dimensions in declared order, the first innermost, torchrec's strided sparse groups) with the same
degrees, memory per GPU, and the planning time (torchrec's ``EmbeddingShardingPlanner`` of the
sparse group included).

Balance: Zipf(alpha=1.2) lengths 1..4096, 32 samples per rank, costs a*len^2 + b*len from
``gem_model.model.flops`` for the GEM-sized model (and a small HSTU, where the quadratic term
weighs more); max/mean of the ranks' cost under random assignment, round robin and ``seq_balanced``,
with the lower bound no equal-count split can beat.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/planner.py --out-json benchmarks/results/raw/planner.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gem_model.config import ModelConfig
from gem_model.data.synthetic import SyntheticConfig, SyntheticSource
from gem_parallel.balance import SeqBalancedBalancer, SeqBalancedConfig, cost_coefficients, max_over_mean
from gem_parallel.sparse_plan import PlanDoesNotFitError
from gem_parallel.topology import h200
from gem_parallel.topology_planner import plan_topology
from gem_parallel.workload import gem_sized

MODELS = {
    "gem-sized (d=2048, 24 blocks, 32x128 heads)": ModelConfig(
        embedding_dim=2048, num_blocks=24, num_heads=32, attention_dim=128, value_dim=128, max_seq_len=4096
    ),
    "small HSTU (d=256, 8 blocks, 4x64 heads)": ModelConfig(
        embedding_dim=256, num_blocks=8, num_heads=4, attention_dim=64, value_dim=64, max_seq_len=4096
    ),
}


def plan_rows(nodes_list: list[int], samples_per_gpu: int, repeat: int) -> list[dict]:
    rows = []
    for nodes in nodes_list:
        topo = h200(nodes)
        w = gem_sized(global_batch_size=samples_per_gpu * topo.world_size)
        start = time.perf_counter()
        try:
            plans = [plan_topology(topo, w) for _ in range(repeat)]
        except PlanDoesNotFitError as exc:
            rows.append({"topology": topo.describe(), "fits": False, "error": str(exc),
                         "planning_seconds": time.perf_counter() - start})
            print(f"\n{topo.describe()}: {exc}")
            continue
        plan = plans[-1]
        secs = sorted(p.seconds for p in plans)
        print("\n" + plan.summary())
        print(f"planned in {secs[0]:.2f} s (fastest of {repeat}; slowest {secs[-1]:.2f} s; "
              f"{plan.torchrec_seconds:.2f} s in torchrec the last time), {plan.candidates} layouts costed")
        rows.append({"fits": True, **plan.to_dict(), "planning_seconds_all": [p.seconds for p in plans],
                     "torchrec_seconds_all": [p.torchrec_seconds for p in plans]})
    return rows


def zipf(n: int, alpha: float, max_len: int, g: torch.Generator) -> torch.Tensor:
    k = torch.arange(1, max_len + 1, dtype=torch.double)
    return torch.multinomial(k**-alpha, n, replacement=True, generator=g) + 1


def balance_rows(ranks_list: list[int], seeds: int, per_rank: int) -> list[dict]:
    spec = SyntheticSource(SyntheticConfig()).feature_spec()
    rows = []
    for model_name, model in MODELS.items():
        a, b = cost_coefficients(model, spec)
        bal = SeqBalancedBalancer(SeqBalancedConfig(attention_coef=a, linear_coef=b))
        for ranks in ranks_list:
            random_, robin, after, bound, secs = [], [], [], [], []
            for seed in range(seeds):
                g = torch.Generator().manual_seed(seed)
                lengths = zipf(per_rank * ranks, 1.2, 4096, g)
                costs = bal.costs(lengths)
                random_.append(max_over_mean(costs, list(torch.randperm(lengths.numel(), generator=g).view(ranks, -1))))
                t = time.perf_counter()
                p = bal.plan(lengths, ranks)
                secs.append(time.perf_counter() - t)
                robin.append(p.load_before)
                after.append(p.load_after)
                bound.append(p.load_bound)
            rows.append({
                "model": model_name, "a": a, "b": b, "ranks": ranks, "samples_per_rank": per_rank, "seeds": seeds,
                "random": random_, "round_robin": robin, "seq_balanced": after, "bound": bound, "seconds": secs,
            })
    return rows


def print_balance(rows: list[dict]) -> None:
    print(f"\n{'model':<44}{'ranks':>6}{'random':>15}{'round robin':>15}{'seq_balanced':>16}{'bound':>9}"
          f"{'<=1.02':>8}{'s/batch':>9}")
    for r in rows:
        def mm(xs: list[float]) -> str:
            return f"{statistics.mean(xs):.3f}/{max(xs):.3f}"
        within = sum(x <= 1.02 for x in r["seq_balanced"])
        print(f"{r['model']:<44}{r['ranks']:>6}{mm(r['random']):>15}{mm(r['round_robin']):>15}"
              f"{mm(r['seq_balanced']):>16}{max(r['bound']):>9.3f}{within:>4}/{r['seeds']:<3}"
              f"{statistics.mean(r['seconds']):>9.3f}")
    print("(mean/max over seeds of max/mean load; bound: the largest over seeds of the best any split can do)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="1,16,128,512", help="H200 nodes of 8 GPUs, comma-separated")
    p.add_argument("--ranks", default="8,64,1024", help="data-parallel ranks for the balance rows")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--samples-per-rank", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3, help="plans per topology (planning time: fastest and slowest)")
    p.add_argument("--out-json")
    args = p.parse_args()
    plans = plan_rows([int(x) for x in args.nodes.split(",")], args.samples_per_rank, args.repeat)
    balance = balance_rows([int(x) for x in args.ranks.split(",")], args.seeds, args.samples_per_rank)
    print_balance(balance)
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump({"config": vars(args), "plans": plans, "balance": balance}, f, indent=1)


if __name__ == "__main__":
    main()
