"""``seq_balanced`` against ``round_robin`` on one GPU: a global batch split over simulated data-parallel ranks.

Each of ``--batches`` global batches (after ``--warmup`` more, untimed) is split over ``--ranks``
simulated ranks by each balancer; the trainer's own step (:class:`gem_model.train.step.CoreStep`:
forward and loss, backward, gradient clipping, the optimizer step; torchrec's fused table update
inside backward; called directly, so no ``gem_train_step`` hook wraps it) then runs on each rank's
share in turn, timed with CUDA events. The slowest rank is that balancer's step: in data
parallelism every rank waits for it at the gradient all-reduce, which this one-GPU simulation
leaves out (the same for both balancers). Global batch = the config's ``data.global_batch_size``,
so each simulated rank trains on ``batch / ranks`` samples. Each share is stepped once untimed just
before its timed step (``--cold``: not): the Triton kernels tune per power of two of a batch's
longest and mean length, and a share of a new shape would otherwise time its tuning. The balancers
alternate which goes first from batch to batch.

Per balancer the table gives the mean over batches of the slowest rank's step, of the mean rank's
step, of max/mean of the measured rank times, and of max/mean of the estimated rank loads. The
estimate is the cost ``seq_balanced`` partitions by (``a*len^2 + b*len``, ``a`` and ``b`` from
``gem_model.model.flops`` for the config's model), applied to both balancers (``round_robin`` has
no estimate of its own); the JSON adds max/mean of the trainer's FLOP count per rank. Before any
timing, every balancer's assignment is checked to place every sample of the global batch on exactly
one rank, and the batches built for the ranks to hold distinct samples, as many as the batch has.

The big config's tables use torchrec's fused kernels, which need a process group, so on the GPU it
runs under torchrun with one process. Expected on one H200 (not yet measured: an estimate from
``benchmarks/results/e2e.md``'s 275 ms bf16 step at 384 samples): ~10 s of imports, ~40 s of model
build (25 GB of tables) and Triton tuning, ~30 s for the 256 steps of 48 samples (8 global batches x
2 balancers x 8 ranks x 2): ~80-110 s for the command, plus the machine's ~45 s start-up::

    torchrun --standalone --nproc-per-node 1 benchmarks/balance_gpu.py --out balance_gpu.json
    python benchmarks/balance_gpu.py -c configs/tiny.yaml --device cpu --ranks 2 --batches 1 --out b.json  # smoke
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from gem_model.components import LoadBalancer
from gem_model.config import RunConfig
from gem_model.config_io import load_config
from gem_model.data.batch import Batch
from gem_model.data.loader import ShardedLoader
from gem_model.data.prefetch import StagedBatch, StepFacts, history_facts
from gem_model.distributed import launched_by_torchrun
from gem_model.model.flops import count_flops
from gem_model.plugins import GemPluginManager
from gem_model.profiling.balance import imbalance
from gem_model.resolve import build_balancer
from gem_model.train.run import Run
from gem_model.trainer import started_run
from gem_parallel.balance import SeqBalancedBalancer, max_over_mean

BALANCERS = ("round_robin", "seq_balanced")


class GivenBatchFeed:
    """The feed the train pipeline reads its batch from: it hands over the batch set last."""

    def __init__(self) -> None:
        self.staged: StagedBatch | None = None

    def get(self, step: int) -> StagedBatch:
        if self.staged is None or self.staged.step != step:
            raise RuntimeError(
                f"no batch was given for step {step}: the train pipeline asked for another step's batch "
                "(a pipeline that reads batches ahead cannot be handed one batch at a time; use trainer.pipeline=sequential)"
            )
        return self.staged


@dataclass
class Timer:
    device: torch.device

    def step_ms(self, run: Run, feed: GivenBatchFeed, batch: Batch, facts: StepFacts, step: int) -> float:
        """One trainer step on ``batch`` (already on the device), in milliseconds of device time."""
        feed.staged = StagedBatch(step, facts, False, batch)
        if self.device.type != "cuda":
            start = time.perf_counter()
            run.core_step(step)
            return 1e3 * (time.perf_counter() - start)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(self.device)  # the previous step's work must not count in this one
        begin.record()
        run.core_step(step)
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)


def run_config(args: argparse.Namespace, workdir: str) -> RunConfig:
    """``--config`` with what a one-process simulation needs: no checkpoint, no evaluation, no prefetch."""
    overrides = [f"trainer.device={args.device}", "trainer.progress=false", "trainer.checkpoint_at_end=false",
                 "trainer.eval_at_end=false", "trainer.prefetch=0", f"trainer.output_dir={workdir}",
                 "trainer.resume=false", *args.set]  # fmt: skip
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    if world != 1:
        raise SystemExit(f"balance_gpu.py simulates the ranks in one process; it was started with {world}")
    return load_config(args.config, overrides)


def check_partition(parts: list[torch.Tensor], batches: list[Batch], size: int, where: str) -> None:
    """Every sample of the global batch on exactly one rank, and the ranks' batches built from those."""
    placed = torch.cat([p.long() for p in parts]) if parts else torch.empty(0, dtype=torch.long)
    outside = placed[(placed < 0) | (placed >= size)]
    if outside.numel():
        raise AssertionError(f"{where}: sample indices outside [0, {size}): {outside[:8].tolist()}")
    counts = torch.bincount(placed, minlength=size)
    if not bool((counts == 1).all()):
        missing, twice = (counts == 0).nonzero().flatten().tolist(), (counts > 1).nonzero().flatten().tolist()
        raise AssertionError(f"{where}: samples on no rank {missing[:8]}, on several ranks {twice[:8]}")
    ids = torch.cat([b.sample_ids for b in batches]) if batches else torch.empty(0, dtype=torch.long)
    if ids.numel() != size or ids.unique().numel() != size:
        raise AssertionError(
            f"{where}: the ranks' batches hold {ids.numel()} sample ids, {ids.unique().numel()} distinct; "
            f"the global batch has {size}"
        )


def measure_batch(run: Run, feed: GivenBatchFeed, timer: Timer, balancer: LoadBalancer, cost: SeqBalancedBalancer,
                  data_step: int, train_step: int, args: argparse.Namespace) -> dict:  # fmt: skip
    """Split global batch ``data_step`` over ``args.ranks`` by ``balancer``, then trainer steps on each
    rank's share in turn: one untimed (unless ``--cold``), then the timed one."""
    ranks = args.ranks
    source, size = run.components.source, run.config.data.global_batch_size
    lengths = source.lengths(data_step, size)
    parts = balancer.assign(lengths, ranks)
    batches = [ShardedLoader(source, balancer, global_batch_size=size, rank=r, world_size=ranks).batch_at(data_step)
               for r in range(ranks)]  # fmt: skip
    check_partition(parts, batches, size, f"{balancer.name}, global batch {data_step}")
    ms = []
    for b in batches:
        on_device, facts = b.to(timer.device), history_facts(b)  # facts from the host copy: no device read
        if not args.cold:  # Triton tunes per power of two of the longest and the mean length: not in the timed step
            timer.step_ms(run, feed, on_device, facts, train_step)
            train_step += 1
        ms.append(timer.step_ms(run, feed, on_device, facts, train_step))
        train_step += 1
    costs = cost.costs(lengths)
    model, spec = run.config.model, run.spec
    return {
        "data_step": data_step,
        "rank_ms": ms,
        "estimated": [float(costs[p].sum()) for p in parts],
        "estimated_max_over_mean": max_over_mean(costs, parts),
        "flops": [count_flops(model, spec, lengths[p]).train_step for p in parts],
        "tokens": [int(lengths[p].sum()) for p in parts],
        "assignment": [p.tolist() for p in parts],
    }


def summarize(rows: list[dict]) -> dict:
    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs)

    return {
        "slowest_rank_ms": mean([max(r["rank_ms"]) for r in rows]),
        "rank_ms": mean([mean(r["rank_ms"]) for r in rows]),
        "measured_max_over_mean": imbalance([r["rank_ms"] for r in rows]),
        "estimated_max_over_mean": mean([r["estimated_max_over_mean"] for r in rows]),
        "flops_max_over_mean": imbalance([r["flops"] for r in rows]),
        "batches": rows,
    }


def run_benchmark(args: argparse.Namespace, workdir: str) -> dict:
    pm = GemPluginManager()
    with started_run(run_config(args, workdir), pm) as run:  # the run as the trainer builds it, not started
        size = run.config.data.global_batch_size
        if size % args.ranks:
            raise SystemExit(f"data.global_batch_size={size} cannot be split evenly over --ranks {args.ranks}")
        balancers = {name: build_balancer(run.config, pm, name, run.spec) for name in BALANCERS}
        cost = balancers["seq_balanced"]
        assert isinstance(cost, SeqBalancedBalancer)
        feed = GivenBatchFeed()
        run.components.pipeline.setup(model=run.prepared.module, optimizers=run.optimizers, feed=feed,
                                      layout=run.layout)  # fmt: skip
        timer = Timer(run.env.device)
        rows: dict[str, list[dict]] = {name: [] for name in BALANCERS}
        train_step = 0
        for data_step in range(args.warmup + args.batches):
            order = BALANCERS if data_step % 2 == 0 else BALANCERS[::-1]  # neither always runs first
            slowest = {}
            for name in order:
                row = measure_batch(run, feed, timer, balancers[name], cost, data_step, train_step, args)
                train_step += args.ranks * (1 if args.cold else 2)
                slowest[name] = max(row["rank_ms"])
                if data_step >= args.warmup:
                    rows[name].append(row)
            label = " (warm-up)" if data_step < args.warmup else ""
            print(
                f"global batch {data_step}{label}: slowest rank "
                + ", ".join(f"{n} {slowest[n]:.1f} ms" for n in BALANCERS),
                flush=True,
            )
        results = {name: summarize(r) for name, r in rows.items()}
        a, b = cost.coefficients or (0.0, 0.0)
        meta = {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name() if run.env.device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "command": " ".join(shlex.quote(x) for x in sys.argv), "config": args.config,
            "overrides": args.set, "ranks": args.ranks, "global_batch_size": size, "per_rank": size // args.ranks,
            "batches": args.batches, "warmup": args.warmup, "cold": args.cold, "cost": {"a": a, "b": b},
            "step": "the trainer's CoreStep: forward and loss, backward (fused table update), clipping, optimizer step",
        }  # fmt: skip
        speedup = results["round_robin"]["slowest_rank_ms"] / results["seq_balanced"]["slowest_rank_ms"]
        return {"meta": meta, "balancers": results, "speedup_seq_balanced_over_round_robin": speedup}


def print_table(out: dict) -> None:
    m = out["meta"]
    print(f"\n{m['global_batch_size']} samples over {m['ranks']} simulated ranks ({m['per_rank']} each), "
          f"{m['batches']} batches after {m['warmup']} warm-up, {m['device']}")  # fmt: skip
    print(f"{'balancer':<14} {'slowest ms':>11} {'mean rank ms':>13} {'max/mean meas':>14} {'max/mean est':>13}")
    for name, r in out["balancers"].items():
        print(f"{name:<14} {r['slowest_rank_ms']:>11.2f} {r['rank_ms']:>13.2f} {r['measured_max_over_mean']:>14.3f} "
              f"{r['estimated_max_over_mean']:>13.3f}")  # fmt: skip
    print(
        f"speed-up of seq_balanced over round_robin (slowest rank): {out['speedup_seq_balanced_over_round_robin']:.3f}x"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-c", "--config", default="configs/h200-large.yaml")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ranks", type=int, default=8, help="simulated data-parallel ranks")
    p.add_argument("--batches", type=int, default=6, help="timed global batches")
    p.add_argument("--warmup", type=int, default=2, help="global batches run first, untimed (Triton tuning)")
    p.add_argument("--cold", action="store_true", help="time each share's first step (no untimed step before it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (repeatable)")
    p.add_argument("--out", default=None, help="write the JSON here")
    args = p.parse_args(argv)
    if args.ranks < 1 or args.batches < 1 or args.warmup < 0:
        p.error("--ranks and --batches must be at least 1, --warmup at least 0")
    with tempfile.TemporaryDirectory(prefix="gem-balance-") as workdir:
        out = run_benchmark(args, workdir)
    print_table(out)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
