"""``gem-train tune -c CONFIG --budget MINUTES``: a coordinate search by short real training runs.

Starting from the config as given (measured first), one dimension at a time, every alternative is
trained for ``steps`` steps on the current device (the ordinary trainer, a scratch output
directory) and kept when its tokens/s beats the best so far, its last loss is at most
``max_loss_increase`` worse than the starting config's, and its peak memory (CUDA) fits
``memory_gb``. The dimensions, in order:

1. ``kernels.jagged_attention``: every registered attention kernel available on the device;
2. precision: the numerics section's per-layer map (``--profile DIR`` with a finished ``numerics`` section),
   then every registered scheme as ``precision.scheme``;
3. ``activation.policy``: every registered policy (the memory budget decides between them);
4. ``data.balancer``: every registered balancer, when the layout has more than one data-parallel rank;
5. ``parallel.planner``: every registered planner that can drive the launched world;
6. ``trainer.compile``: the other setting, on a GPU (the profile recommends it when pointwise work
   is large; on a CPU inductor's C++ build takes minutes, so it is not tried there).

A process's first run is slower than later ones (Triton compiles and tunes the kernels, 0.6x on the
big config), so the search first trains the starting config once, uncounted (``warmup``), and with
``repeats`` > 1 every config is trained that many times in a row and its last run counts: a
candidate's first run still compiles the kernels only it uses.

A candidate that fails (a kernel the device lacks, a planner that needs a process group, a NaN) is
recorded with its error and never chosen. Before each candidate the search checks that the slowest
run so far still fits in what is left of the budget, so it stops within it; every candidate it had
no time for is recorded as not measured (``skipped``), so the table shows what the budget left out.
With a profile that has a ``memory`` section and a ``memory_gb``, the activation policies are not
measured when the configured one fits: another policy only trades speed for memory. On a GPU, a
precision scheme whose GEMMs run in more bits than the configured scheme's is not measured either:
it cannot be faster there (on this config fp32 is ~40 s a step against ~0.3 s in bf16). Nor is a
scheme the profile's ``numerics`` section, taken on this device from the same configured scheme,
measured emulated here or slower than the configured one on the model's linears (MX on Hopper:
0.37x, and out of memory, in the H200 search of 2026-12-01).

Each candidate after the first runs under ``trainer.time_limit_s`` = what is left of the budget; one
that stops early is recorded with its error and never chosen, so the search ends within the budget
plus one candidate's start-up and one step. ``tune.json`` is rewritten after every candidate
(``"complete": false`` until the end), so a search killed from outside keeps what it measured.
"""

from __future__ import annotations

import gc
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from gem_model.config import RunConfig
from gem_model.config_io import apply_overrides, dump, validate
from gem_model.distributed import DistEnv, launched_by_torchrun, pick_device
from gem_model.errors import ConfigError, GemError
from gem_model.plugins import GemPluginManager
from gem_model.profiling.report import ProfileReport
from gem_model.train.progress import task_progress
from gem_model.train.report import summaries_printed
from gem_model.tune.skips import pruned, slower_here, wider_gemms

DIMENSIONS = {"kernel": "attention kernel", "precision": "precision", "activation": "activation policy",
              "balancer": "balancer", "planner": "planner", "compile": "compile"}  # fmt: skip
"""``--dimensions`` names -> the dimensions of the search, in its order."""


@dataclass
class Candidate:
    dimension: str
    overrides: dict[str, Any]
    """Dotted config keys -> values, on top of the best config so far."""
    tokens_per_s: float | None = None
    peak_memory_gb: float | None = None
    last_loss: float | None = None
    seconds: float = 0.0
    error: str | None = None
    chosen: bool = False
    skipped: str | None = None
    """Why it was not measured (the budget, or the profile says it cannot win); None: it was."""


@dataclass
class TuneResult:
    baseline: Candidate
    candidates: list[Candidate]
    best: RunConfig
    best_overrides: dict[str, Any] = field(default_factory=dict)
    stopped_by_budget: bool = False
    seconds: float = 0.0
    complete: bool = True
    """False while the search still runs (the ``tune.json`` written after each candidate)."""
    warmup_seconds: float = 0.0
    """The uncounted first run of the starting config (0: none)."""

    def to_dict(self) -> dict[str, Any]:
        return {"baseline": asdict(self.baseline), "candidates": [asdict(c) for c in self.candidates],
                "best_overrides": self.best_overrides, "stopped_by_budget": self.stopped_by_budget,
                "seconds": self.seconds, "complete": self.complete, "warmup_seconds": self.warmup_seconds}  # fmt: skip


def with_overrides(config: RunConfig, overrides: dict[str, Any]) -> RunConfig:
    data = config.model_dump(mode="json")
    for key, value in overrides.items():  # a whole precision block replaces the old one
        if key == "precision":
            data["precision"] = value
    rest = [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in overrides.items() if k != "precision"]
    return validate(apply_overrides(data, rest))


class CutOff(GemError):
    """A candidate run stopped by its time limit before its last step: its figures are not comparable."""


def measure(
    config: RunConfig, pm: GemPluginManager, steps: int, time_limit_s: float | None = None, *, repeats: int = 1
) -> tuple[float, float | None, float]:
    """:func:`measure_once` ``repeats`` times in a row, sharing ``time_limit_s``: the last run's figures."""
    deadline = None if time_limit_s is None else time.perf_counter() + time_limit_s
    for _ in range(repeats):
        left = None if deadline is None else max(deadline - time.perf_counter(), 1e-9)
        figures = measure_once(config, pm, steps, left)
    return figures


def measure_once(
    config: RunConfig, pm: GemPluginManager, steps: int, time_limit_s: float | None = None
) -> tuple[float, float | None, float]:
    """Train ``steps`` steps of ``config`` in a scratch directory: (tokens/s, peak GB or None, last loss).

    ``time_limit_s``: the trainer's own limit on the loop; a run it stops early raises :class:`CutOff`.
    The model is released and the CUDA cache emptied afterwards, so candidates do not stack up (the
    big config's tables are 25 GB)."""
    from gem_model.trainer import train

    scratch = tempfile.mkdtemp(prefix="gem-tune-")
    device = pick_device(config.trainer.device, int(os.environ.get("LOCAL_RANK", "0")))
    trainer = config.trainer.model_copy(update={
        "steps": steps, "output_dir": scratch, "checkpoint_every": 0, "checkpoint_at_end": False, "eval_every": 0,
        "eval_at_end": False, "progress": False, "log_every": steps, "resume": False, "time_limit_s": time_limit_s,
    })  # fmt: skip
    try:
        if device.type == "cuda":
            torch.cuda.init()  # the allocator's statistics exist only once CUDA is initialised
            torch.cuda.reset_peak_memory_stats(device)
        with summaries_printed(False):  # tune's table reports each candidate
            summary = train(config.model_copy(update={"trainer": trainer}), pm)
        if summary.steps < steps:
            raise CutOff(f"stopped by its time limit ({time_limit_s:.0f} s, what was left of the budget) after "
                         f"{summary.steps} of {steps} steps")  # fmt: skip
        peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
        return summary.tokens_per_s, peak, summary.last_loss
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def dimensions(config: RunConfig, pm: GemPluginManager, profile: ProfileReport | None) -> list[tuple[str, list[dict[str, Any]]]]:
    device = pick_device(config.trainer.device, 0)
    kernels = []
    for name in pm.kernel_registry("jagged_attention").names():
        cls = pm.kernel_registry("jagged_attention").get(name).cls
        try:
            cls().check_available(device)
        except GemError:
            continue
        kernels.append({"kernels.jagged_attention": name})
    if profile is not None and profile.has("numerics") and "precision_yaml" in profile.section("numerics").summary:
        block = yaml.safe_load(profile.section("numerics").summary["precision_yaml"])["precision"]
        precision = [{"precision": block}]
    else:
        precision = []
    precision += [{"precision.scheme": n} for n in pm.precision_schemes.names()]
    world = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    # only planners that can drive this process's world: one that needs a process group cannot run
    # in a process torchrun did not start
    planners = [{"parallel.planner": n} for n in pm.parallel_planners.names()
                if (pm.parallel_planners.get(n).cls.max_world_size or world) >= world
                and (launched_by_torchrun() or not pm.parallel_planners.get(n).cls.needs_process_group)]  # fmt: skip
    entry = pm.parallel_planners.get(config.parallel.planner.name)
    dp = entry.cls(entry.cls.Config.model_validate(config.parallel.planner.options)).layout(
        DistEnv(0, world, 0, device, None)).dp_degree  # fmt: skip
    balancers = [{"data.balancer": n} for n in pm.load_balancers.names()] if dp > 1 else []
    # on a GPU, compiling the blocks fuses their pointwise kernels; on a CPU inductor builds C++ for minutes
    compile_ = [{"trainer.compile": not config.trainer.compile}] if device.type == "cuda" else []
    return [
        ("attention kernel", kernels), ("precision", precision),
        ("activation policy", [{"activation.policy": n} for n in pm.activation_policies.names()]),
        ("balancer", balancers), ("planner", planners), ("compile", compile_),
    ]  # fmt: skip


def _same(config: RunConfig, overrides: dict[str, Any]) -> bool:
    return with_overrides(config, overrides) == config


def tune(
    config: RunConfig, pm: GemPluginManager, *, budget_s: float, steps: int = 6, memory_gb: float | None = None,
    max_loss_increase: float = 0.05, profile: ProfileReport | None = None, only: tuple[str, ...] | None = None,
    on_candidate: Callable[[TuneResult], None] | None = None, warmup: bool = True, repeats: int = 1,
) -> TuneResult:
    """``only``: the :data:`DIMENSIONS` names to search (None: all); the others' candidates are
    recorded as not searched. ``on_candidate``: called with the result so far (``complete`` False)
    after every measured candidate. ``warmup``: train the starting config once first, uncounted;
    ``repeats``: runs per config, the last one counts."""
    check_dimensions(only)
    searched = None if only is None else {DIMENSIONS[n] for n in only}
    # live progress (on a terminal): seconds of the budget spent, one advance per candidate run
    with task_progress(max(1, math.ceil(budget_s)), "tune", unit="s") as advance:
        shown = 0

        def spent() -> None:
            nonlocal shown
            now = min(math.ceil(budget_s), round(time.perf_counter() - start))
            advance(max(0, now - shown))
            shown = max(shown, now)

        start = time.perf_counter()
        return _search(config, pm, start, spent, steps=steps, budget_s=budget_s, memory_gb=memory_gb,
                       max_loss_increase=max_loss_increase, profile=profile, searched=searched,
                       on_candidate=on_candidate or (lambda _: None), warmup=warmup, repeats=repeats)  # fmt: skip


def check_dimensions(only: tuple[str, ...] | None) -> None:
    unknown = [n for n in only or () if n not in DIMENSIONS]
    if unknown or only == ():
        raise ConfigError([("--dimensions", ",".join(unknown), f"name dimensions of the search: {', '.join(DIMENSIONS)}")])


def _search(
    config: RunConfig, pm: GemPluginManager, start: float, spent: Callable[[], None], *, steps: int, budget_s: float,
    memory_gb: float | None, max_loss_increase: float, profile: ProfileReport | None, searched: set[str] | None,
    on_candidate: Callable[[TuneResult], None], warmup: bool, repeats: int,
) -> TuneResult:
    warmup_s = 0.0
    if warmup:  # compiles and tunes the kernels the starting config uses: not a figure
        measure(config, pm, steps)
        warmup_s = time.perf_counter() - start
    baseline = Candidate("baseline", {})
    t0 = time.perf_counter()
    baseline.tokens_per_s, baseline.peak_memory_gb, baseline.last_loss = measure(config, pm, steps, repeats=repeats)
    baseline.seconds = slowest = time.perf_counter() - t0
    spent()
    best, best_overrides, best_tps = config, {}, baseline.tokens_per_s
    tried: list[Candidate] = []
    stopped = False
    device = pick_device(config.trainer.device, 0)
    on_candidate(TuneResult(baseline, [], best, {}, False, time.perf_counter() - start, complete=False))
    for dimension, options in dimensions(config, pm, profile):
        current = best  # the value this dimension starts from was measured already
        skip = "not searched (--dimensions)" if searched is not None and dimension not in searched else None
        skip = skip or pruned(dimension, config, profile, memory_gb)
        for overrides in options:
            if _same(current, overrides):
                continue
            c = Candidate(dimension, overrides)
            left = budget_s - (time.perf_counter() - start)
            why = skip or wider_gemms(config, overrides, pm, device) or slower_here(config, overrides, profile, device)
            if why or stopped or left < slowest:
                stopped = stopped or (why is None)
                c.skipped = why or f"not measured: {max(left, 0):.0f} s of the budget left, the slowest run took {slowest:.0f} s"
                tried.append(c)
                continue
            t0 = time.perf_counter()
            try:
                c.tokens_per_s, c.peak_memory_gb, c.last_loss = measure(
                    with_overrides(best, overrides), pm, steps, left, repeats=repeats)
            except Exception as exc:  # a candidate that cannot run is a result, not the end of the search
                c.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            c.seconds = time.perf_counter() - t0
            spent()
            slowest = max(slowest, c.seconds)
            tried.append(c)
            if c.error is None and _acceptable(c, baseline, memory_gb, max_loss_increase) and c.tokens_per_s > best_tps:
                best, best_tps = with_overrides(best, overrides), c.tokens_per_s
                best_overrides = {**best_overrides, **overrides}
            on_candidate(TuneResult(baseline, list(tried), best, best_overrides, stopped,
                                    time.perf_counter() - start, complete=False))  # fmt: skip
    for c in tried:
        c.chosen = c.skipped is None and all(best_overrides.get(k) == v for k, v in c.overrides.items())
    return TuneResult(baseline, tried, best, best_overrides, stopped, time.perf_counter() - start,
                      warmup_seconds=warmup_s)


def compare(configs: dict[str, RunConfig], pm: GemPluginManager, steps: int) -> list[Candidate]:
    """Measure two configs (name -> config) the same way: ``gem-train tune --compare``.

    A process's first run pays for compiling and tuning kernels (Triton's autotuner, the length
    buckets a run meets first), so an uncounted run of A comes first; then A, B, B, A, so that drift
    over the process's life counts against neither. Returns the four runs in that order; :func:`compare_means` averages them."""
    if len(configs) != 2:
        raise ConfigError([("--compare", list(configs), "compares exactly two configs")])
    a, b = configs.items()
    measure(a[1], pm, steps)  # a first run that compiles and tunes the kernels: not counted
    out = []
    for name, config in (a, b, b, a):
        c = Candidate("compare", {"config": name})
        t0 = time.perf_counter()
        c.tokens_per_s, c.peak_memory_gb, c.last_loss = measure(config, pm, steps)
        c.seconds = time.perf_counter() - t0
        out.append(c)
    return out


def compare_means(runs: list[Candidate]) -> dict[str, dict[str, float | None]]:
    """Per config (in first-seen order): the mean tokens/s, the largest peak GB and the mean last loss of its runs."""
    names = list(dict.fromkeys(c.overrides["config"] for c in runs))
    out: dict[str, dict[str, float | None]] = {}
    for name in names:
        mine = [c for c in runs if c.overrides["config"] == name]
        peaks = [c.peak_memory_gb for c in mine if c.peak_memory_gb is not None]
        out[name] = {"tokens_per_s": sum(c.tokens_per_s or 0.0 for c in mine) / len(mine),
                     "peak_memory_gb": max(peaks) if peaks else None,
                     "last_loss": sum(c.last_loss or 0.0 for c in mine) / len(mine), "runs": len(mine)}  # fmt: skip
    return out


def _acceptable(c: Candidate, baseline: Candidate, memory_gb: float | None, max_loss_increase: float) -> bool:
    if c.last_loss is None or not math.isfinite(c.last_loss):
        return False
    if baseline.last_loss is not None and c.last_loss > baseline.last_loss * (1 + max_loss_increase):
        return False
    return memory_gb is None or c.peak_memory_gb is None or c.peak_memory_gb <= memory_gb


def tuned_run(best: RunConfig) -> RunConfig:
    """``best`` as a run of its own, ``<name>-tuned``: ``gem-train run -c tuned.yaml`` then writes
    where the tuned config's own checkpoints (another run, by identity) are not."""
    tc = best.trainer
    out = tc.output_dir if "{name}" in tc.output_dir else tc.output_dir.rstrip("/") + "-tuned"
    return best.model_copy(update={"name": f"{best.name}-tuned", "trainer": tc.model_copy(update={"output_dir": out})})


def write_result(result: TuneResult, out: Path) -> dict[str, Path]:
    import json

    out.mkdir(parents=True, exist_ok=True)
    paths = {"config": out / "tuned.yaml", "table": out / "tune.json"}
    head = f"# gem-train tune: chosen overrides {result.best_overrides or 'none (the config as given was fastest)'}\n"
    if not result.complete:
        head += f"# the search is still running ({len(result.candidates)} candidate(s) so far): this is the best yet\n"
    paths["config"].write_text(head + dump(tuned_run(result.best)))
    paths["table"].write_text(json.dumps(result.to_dict(), indent=1))
    return paths
