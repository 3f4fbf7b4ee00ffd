"""One torchrun start of N gloo processes that trains every layout it is given, in turn.

``python -m torch.distributed.run --nproc-per-node N layouts_worker.py OUT NAME=OVERRIDES...``:
for each layout, 4 steps of the tiny run under ``parallel.planner=fsdp`` with a checkpoint after
step 2, then a second run in the same processes that resumes that checkpoint and trains steps 3-4.
Rank 0 writes ``OUT/results.json``: per layout, the step losses of both runs and the layout and
placement each run reported, and every rank's digest of its dense weights before the first step
(whole tensors: DTensors gathered) and of its table shards after the last.

A rank still running after ``GEM_TEST_HANG_S`` seconds (default 240) prints every thread's stack to
stderr and exits 1 (``faulthandler``), so a start that hangs fails with the stacks of where it hung
instead of being killed silently at the test's time limit.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

import gem_parallel.plugin
from gem_model import testing
from gem_model.checks import check_run
from gem_model.config_io import load_config
from gem_model.distributed import init_distributed, leave_rank, teardown
from gem_model.plugins import GemPluginManager
from gem_model.resolve import resolve_components
from gem_model.results import RunSummary
from gem_model.testing_faults import tensor_digest
from gem_model.train.run import Run

STEPS = 4
CHECKPOINT_AT = 2


def losses(out: Path) -> list[float]:
    return [json.loads(x)["step_loss"] for x in (out / "metrics.jsonl").read_text().splitlines() if "step_loss" in x]




def every_rank(value: str) -> list[str]:
    out: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def dense_digest(run: Run) -> list[str]:
    """Every rank's digest of the whole dense weights (a collective: DTensors are gathered)."""
    params = [p.full_tensor() if isinstance(p, DTensor) else p for _, p in run.prepared.dense_parameters]
    return every_rank(tensor_digest(params))


def table_shards_digest(run: Run) -> list[str]:
    """Every rank's digest of the table shards it holds (local shards of torchrec's ShardedTensors)."""
    shards = [
        s.tensor for _, v in sorted(run.prepared.module.state_dict().items()) if isinstance(v, ShardedTensor)
        for s in sorted(v.local_shards(), key=lambda s: s.metadata.shard_offsets)
    ]  # fmt: skip
    return every_rank(tensor_digest(shards))


def train(overrides: list[str]) -> tuple[Run, RunSummary, dict[str, list[str]]]:
    config = load_config(None, overrides)
    pm = GemPluginManager(autoload=False, plugins=[testing, gem_parallel.plugin])
    components = resolve_components(config, pm)
    check_run(config, components, int(os.environ["WORLD_SIZE"]))  # before the group, as gem-train run
    env = init_distributed(config.trainer.device, timeout_s=config.trainer.collective_timeout_s)
    run = Run(config, pm, components, env)
    digests = {"dense_before": dense_digest(run)}
    summary = run.fit()
    digests["tables_after"] = table_shards_digest(run)
    return run, summary, digests


def main(out: Path, layouts: list[str], common: list[str]) -> None:
    results: dict[str, dict[str, object]] = {}
    env = None
    for item in layouts:
        name, _, options = item.partition("=")
        where = out / name
        overrides = [*common, "parallel.planner=fsdp", *options.split(","), f"trainer.output_dir={where}"]
        overrides = [o for o in overrides if o]
        first, summary, digests = train([*overrides, f"trainer.steps={STEPS}", f"trainer.checkpoint_every={CHECKPOINT_AT}"])
        env = first.env
        trained = losses(where)
        resumed, _, _ = train([*overrides, f"trainer.steps={STEPS}", "trainer.resume=true"])
        results[name] = {
            "losses": trained,
            "resumed": losses(where)[CHECKPOINT_AT:],
            "start_step": resumed.start_step,
            "layout": summary.extra["layout"],
            "placement": summary.extra["plan"],
            "plan": first.plan.to_dict(),
            **digests,
        }
    if env is not None:
        if env.is_main:
            (out / "results.json").write_text(json.dumps(results, indent=1))
        teardown(env)


if __name__ == "__main__":
    out_dir, rest = Path(sys.argv[1]), sys.argv[2:]
    split = rest.index("--")
    faulthandler.dump_traceback_later(float(os.environ.get("GEM_TEST_HANG_S", "240")), exit=True)
    main(out_dir, rest[:split], rest[split + 1 :])
    # as gem-train run ends a torchrun rank: the torchrec gloo group torn down with the interpreter aborts
    # the rank now and then (SIGABRT, seen once in ~40 starts of this worker), after everything was written
    leave_rank(0)
