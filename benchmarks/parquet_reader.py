"""Rows/s and tokens/s of the ``parquet`` source per reader process, against what one H200 trains on.

The data is written first: synthetic Parquet shaped like ``configs/h200-large.yaml``'s input, drawn by
the ``synthetic`` source with that config's options (histories with P(n) ~ (n + 1)^-0.95 over
0..4,095, mean ~540; 5M items, 1M users; 4 pooled side features, 8 dense features, 2 labels, a
candidate), plus per-event action types and timestamps. Row groups of ``--row-group-size`` rows,
zstd, page checksums: what ``gem-train data convert`` writes.

Each reader process builds the ``parquet`` source and reads whole global batches (384 samples, one
rank: the H200 run's batch) the way the trainer does: ``ShardedLoader.batch_at`` = the lengths of
the global batch, the balancer, this rank's samples, the batch checks. With ``--workers N``, N
processes read disjoint steps at the same time (worker w reads steps w, w + N, ...), each with one
pyarrow and one torch thread; a row is counted once per process that reads it. A process's cache
holds one step's row groups, and it comes back to a row group only after others (an epoch of the
file is 32 steps), so every step decodes its row groups; the file itself is in the page cache (it was
just written): this measures decoding and batch building, not the disk. Per worker count the
table shows the figures per process and for all of them, and the margin against the trainer's
consumption on one H200 (``e2e.md``: 801,205 tokens/s for h200-large, 2026-12-01).

    .venv/bin/python benchmarks/parquet_reader.py --workers 1,2,4 --out benchmarks/results/raw/parquet_reader-DATE.json

``--checks-cost`` reads the file once more in one process with the value checks turned off (ids in
their tables, the stored lengths, each event's time against its request time) and reports what they
cost a global batch, against the training step (as ``id_check.py`` does for the loader's id check).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

H200_TOKENS_PER_S = 801_205.0  # benchmarks/results/e2e.md, overlapped_input row, 2026-12-01
STEP_MS = 275.0  # the bf16 step of h200-large in benchmarks/results/e2e.md (what id_check.py compares with)
BATCH = 384
SYNTHETIC = {"num_items": 5_000_000, "num_users": 1_000_000, "max_len": 4095, "num_negatives": 128, "length_exponent": 0.95}


def write_data(path: Path, rows: int, row_group_size: int, seed: int = 0) -> dict[str, Any]:
    """``rows`` samples of the h200-large input as one Parquet file; returns its facts."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from gem_model.data.synthetic import SyntheticConfig, SyntheticSource

    source = SyntheticSource(SyntheticConfig(seed=seed, **SYNTHETIC))
    rng = np.random.default_rng(seed)
    writer = None
    tokens = 0
    for step in range(-(-rows // row_group_size)):
        b = min(row_group_size, rows - step * row_group_size)
        batch = source.make_batch(step, b, torch.arange(b))
        lengths = batch.history_lengths().numpy()
        tokens += int(lengths.sum())
        offsets = np.zeros(b + 1, dtype=np.int32)
        np.cumsum(lengths, out=offsets[1:])
        times = 1_700_000_000 + np.cumsum(rng.integers(1, 3600, size=int(lengths.sum())))

        def jagged(values: Any, dtype: Any, offsets: Any = offsets) -> Any:
            return pa.ListArray.from_arrays(pa.array(offsets), pa.array(np.asarray(values, dtype=dtype)))

        seq = batch.sequence
        columns: dict[str, Any] = {
            "history_length": pa.array(lengths.astype(np.int32)),
            "history_item": jagged(seq["seq_item"].values().numpy(), np.int32),
            "history_action": jagged(seq["seq_action"].values().numpy(), np.int8),
            "history_time": jagged(times, np.int64),
            "request_time": pa.array(np.full(b, int(times[-1]) if times.size else 0, dtype=np.int64)),
            "candidate": pa.array(seq["cand_item"].values().numpy().astype(np.int32)),
        }
        for name in batch.pooled.keys():
            columns[name] = pa.array(batch.pooled[name].values().numpy().astype(np.int32))
        for j in range(batch.dense.shape[1]):
            columns[f"dense_{j}"] = pa.array(batch.dense[:, j].numpy())
        for j, task in enumerate(("click", "conversion")):
            columns[task] = pa.array(batch.labels[:, j].numpy())
        table = pa.table(columns)
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema, compression="zstd", write_page_checksum=True)
        writer.write_table(table, row_group_size=row_group_size)
    assert writer is not None
    writer.close()
    spec = source.feature_spec()
    return {"rows": rows, "tokens": tokens, "bytes": path.stat().st_size, "row_group_size": row_group_size,
            "pooled": [(p.name, p.num_embeddings) for p in spec.pooled], "num_dense": spec.num_dense}  # fmt: skip


def source_options(path: Path, facts: dict[str, Any], shuffle: str) -> dict[str, Any]:
    return {
        "path": str(path),
        "num_items": SYNTHETIC["num_items"],
        "num_actions": 4,
        "max_len": SYNTHETIC["max_len"],
        "num_negatives": SYNTHETIC["num_negatives"],
        "shuffle": shuffle,
        # one step's row groups fit (its lengths, then its rows), no more: every step decodes its data
        # (shuffled: the two windows of 4 row groups a step can span)
        "cache_row_groups": 4 if shuffle == "none" else 8,
        "columns": {"candidate": "candidate", "history_length": "history_length"},
        "pooled": [{"feature": n, "column": n, "num_embeddings": k} for n, k in facts["pooled"]],
        "dense": [f"dense_{j}" for j in range(facts["num_dense"])],
        "labels": [{"task": t, "column": t} for t in ("click", "conversion")],
    }


CHECKS = ("_check_range", "check_length_column", "check_times_before_requests")
"""The reader's value checks (ids in their tables, stored lengths, times before the request), which
``--checks-cost`` turns off in a second pass to measure what they cost."""


def read_steps(
    options: dict[str, Any], worker: int, workers: int, steps: int, start: Any, out: Any, checks: bool = True
) -> None:
    """One reader process: ``steps`` global batches, steps ``worker + k * workers``."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import pyarrow as pa
    import torch

    if not checks:
        from gem_model.data import parquet_decode

        for name in CHECKS:
            setattr(parquet_decode, name, lambda *args, **kwargs: None)

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    torch.set_num_threads(1)
    from gem_model.data.balance import RoundRobinBalancer
    from gem_model.data.loader import ShardedLoader
    from gem_model.data.parquet import ParquetSource
    from gem_model.data.parquet_schema import ParquetConfig

    loader = ShardedLoader(ParquetSource(ParquetConfig(**options)), RoundRobinBalancer(), global_batch_size=BATCH)
    loader.batch_at(10_000 + worker)  # imports, first file reads: not timed
    start.wait()
    rows = tokens = 0
    began, cpu = time.perf_counter(), time.process_time()
    for k in range(steps):
        batch = loader.batch_at(worker + k * workers)
        rows += batch.batch_size
        tokens += int(batch.history_lengths().sum())
    seconds, cpu = time.perf_counter() - began, time.process_time() - cpu  # cpu: all of its threads
    out.put({"worker": worker, "seconds": seconds, "cpu_seconds": cpu, "rows": rows, "tokens": tokens})


def measure(options: dict[str, Any], workers: int, steps: int, checks: bool = True) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Barrier(workers + 1), ctx.Queue()
    procs = [ctx.Process(target=read_steps, args=(options, w, workers, steps, start, out, checks)) for w in range(workers)]
    for p in procs:
        p.start()
    start.wait()
    results = sorted((out.get(timeout=900) for _ in procs), key=lambda r: r["worker"])
    for p in procs:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a reader process exited with {p.exitcode}")
    per_proc_tokens = [r["tokens"] / r["seconds"] for r in results]
    per_proc_rows = [r["rows"] / r["seconds"] for r in results]
    wall = max(r["seconds"] for r in results)
    total_tokens = sum(r["tokens"] for r in results) / wall
    return {
        "workers": workers,
        "steps_per_worker": steps,
        "per_process": results,
        "rows_per_s_per_process": sum(per_proc_rows) / workers,
        "tokens_per_s_per_process": sum(per_proc_tokens) / workers,
        "rows_per_s_total": sum(r["rows"] for r in results) / wall,
        "tokens_per_s_total": total_tokens,
        "x_h200": total_tokens / H200_TOKENS_PER_S,
        "cpu_per_wall": sum(r["cpu_seconds"] for r in results) / sum(r["seconds"] for r in results),
        "tokens_per_cpu_s": sum(r["tokens"] for r in results) / sum(r["cpu_seconds"] for r in results),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| order | reader processes | rows/s per process | tokens/s per process | rows/s, all | tokens/s, all | x one H200 (801,205 tokens/s) | CPU s / wall s per process | tokens per CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['order']} | {r['workers']} | {r['rows_per_s_per_process']:,.0f} | {r['tokens_per_s_per_process']:,.0f} | "
            f"{r['rows_per_s_total']:,.0f} | {r['tokens_per_s_total']:,.0f} | {r['x_h200']:.2f}x | {r['cpu_per_wall']:.2f} | {r['tokens_per_cpu_s']:,.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,4", help="comma-separated reader process counts")
    parser.add_argument("--rows", type=int, default=32 * BATCH, help="rows of the file written")
    parser.add_argument("--row-group-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=40, help="global batches each process reads")
    parser.add_argument("--shuffle-too", default="row_groups,rows", help="shuffle orders also measured, one process each")
    parser.add_argument("--data", type=Path, default=Path("/tmp/gem-parquet-reader/h200-large.parquet"))
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--checks-cost", action="store_true",
                        help="also read the file with the value checks off (one process, file order): their cost a step")
    parser.add_argument("--step-ms", type=float, default=STEP_MS,
                        help=f"the training step the checks' cost is set against (default {STEP_MS}: e2e.md's bf16 step)")  # fmt: skip
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    if BATCH > 3 * args.row_group_size:
        raise SystemExit("--row-group-size: one step's row groups must fit the reader's cache of 4")
    args.data.parent.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    began = time.perf_counter()
    facts = write_data(args.data, args.rows, args.row_group_size)
    print(f"wrote {facts['rows']:,} rows, {facts['tokens']:,} tokens, {facts['bytes'] / 2**20:.1f} MiB "
          f"in {time.perf_counter() - began:.1f} s: {args.data}", flush=True)  # fmt: skip
    rows = []
    for workers in counts:
        r = measure(source_options(args.data, facts, shuffle="none"), workers, args.steps)
        rows.append({"order": "none (file order)", **r})
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    for shuffle in args.shuffle_too.split(",") if args.shuffle_too else []:
        r = measure(source_options(args.data, facts, shuffle=shuffle), 1, args.steps)
        rows.append({"order": shuffle, **r})
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    checks_cost = None
    if args.checks_cost:
        on = next(r for r in rows if r["order"].startswith("none") and r["workers"] == 1)
        off = measure(source_options(args.data, facts, shuffle="none"), 1, args.steps, checks=False)
        per_step = [1e3 * r["per_process"][0]["seconds"] / r["steps_per_worker"] for r in (on, off)]
        checks_cost = {"ms_per_step_with": per_step[0], "ms_per_step_without": per_step[1],
                       "ms_per_step": per_step[0] - per_step[1], "step_ms": args.step_ms,
                       "share_of_step": (per_step[0] - per_step[1]) / args.step_ms, "checks": list(CHECKS)}  # fmt: skip
    print()
    print(table(rows))
    if checks_cost is not None:
        c = checks_cost
        print(f"\nthe value checks ({', '.join(CHECKS)}): {c['ms_per_step']:.2f} ms a global batch of {BATCH} "
              f"({c['ms_per_step_with']:.1f} ms read with them, {c['ms_per_step_without']:.1f} ms without), "
              f"{100 * c['share_of_step']:.2f} % of the {c['step_ms']:.0f} ms training step; in the prefetch "
              "thread, off the step's critical path")  # fmt: skip
    if args.out is not None:
        import pyarrow

        record = {
            "date": subprocess.run(["date"], capture_output=True, text=True).stdout.strip(),
            "device": f"this CPU: {os.cpu_count()} cores ({platform.processor() or platform.machine()})",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "pyarrow": pyarrow.__version__,
            "global_batch_size": BATCH,
            "data": {**facts, "synthetic_options": SYNTHETIC},
            "h200_tokens_per_s": H200_TOKENS_PER_S,
            "load_average_before_after": [load_before, os.getloadavg()],
            "rows": rows,
            "checks_cost": checks_cost,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
