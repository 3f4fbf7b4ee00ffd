"""The order of a profile: the real steps first, then every section on rank 0 alone.

1. step time: ``warmup + steps`` real training steps (every rank of a torchrun launch takes part;
   the process group is gone when they end), which also gives the measured memory peak, the comm
   strategy's measurements and the MFU inputs;
2. on global rank 0: sequences, balance, memory, communication (the core's), the plugins'
   sections (``gem_profile_sections``), MFU, and last the recommendations of all of them.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from gem_model.config import RunConfig
from gem_model.data.loader import ShardedLoader
from gem_model.distributed import DistEnv, launched_by_torchrun, pick_device
from gem_model.errors import ConfigError, PluginError
from gem_model.model.gem import GemModel
from gem_model.plugins import GemPluginManager
from gem_model.profiling.balance import balance_section
from gem_model.profiling.comm import comm_section
from gem_model.profiling.context import ProfileContext
from gem_model.profiling.memory import memory_section
from gem_model.profiling.mfu import mfu_section
from gem_model.profiling.recommend import recommendations_section
from gem_model.profiling.report import ProfileReport, ProfileSection
from gem_model.profiling.sequences import read_history, sequences_section
from gem_model.profiling.step_time import measure_steps, step_time_section
from gem_model.resolve import resolve_components
from gem_model.train.prepare import offline_plan
from gem_model.train.progress import task_progress

T = TypeVar("T")


@dataclass(frozen=True)
class ProfileOptions:
    out: Path
    batches: int = 8
    """Global batches the data sections read (from step 0)."""
    warmup: int = 2
    steps: int = 3
    """Measured training steps (after ``warmup``)."""
    world: int | None = None
    """Processes to assume for balance, memory and communication (None: the launched world)."""
    baseline: Path | None = None
    """A one-GPU profile's directory: its tokens/s is the scaling-efficiency baseline."""

    def check(self) -> None:
        problems: list[tuple[str, object, str]] = []
        for flag, value, least in (("--batches", self.batches, 1), ("--steps", self.steps, 1), ("--warmup", self.warmup, 0)):
            if value < least:
                problems.append((flag, value, f"must be at least {least}"))
        if self.world is not None and self.world < 1:
            problems.append(("--world", self.world, "must be at least 1"))
        if problems:
            raise ConfigError(problems)


def _baseline_tokens_per_s(path: Path | None) -> float | None:
    if path is None:
        return None
    report = ProfileReport.from_json((path / "profile.json").read_text())
    return float(report.section("mfu").summary["tokens_per_s"])


def run_profile(config: RunConfig, pm: GemPluginManager, options: ProfileOptions) -> ProfileReport | None:
    """Profile ``config``; the report on global rank 0, None on the other ranks."""
    options.check()
    components = resolve_components(config, pm)
    launched = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    world = options.world or launched
    limit = components.planner.max_world_size
    if limit is not None and world > limit:
        raise ConfigError([("--world", world, f"parallel.planner {components.planner.name!r} drives at most {limit}")])
    probe = measure_steps(config, pm, warmup=options.warmup, steps=options.steps)
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    device = pick_device(config.trainer.device, int(os.environ.get("LOCAL_RANK", "0")))
    layout = components.planner.layout(DistEnv(0, world, 0, device, None))
    ctx = ProfileContext(config, pm, device, world, layout.dp_degree, options.batches, options.out, probe.measured())
    spec = components.source.feature_spec()
    history = read_history(ctx, components.source)
    plan = offline_plan(config, components, world_size=world)
    loader = ShardedLoader(components.source, components.balancer, global_batch_size=config.data.global_batch_size,
                           world_size=layout.dp_degree)  # fmt: skip
    # only the dense parameters' sizes are read off this one: its tables stay on the meta device
    sizes_model = GemModel(config.model.model_copy(update={"table_init": "device", "embedding_init_std": None}), spec,
                           attention=components.attention, norm_gate=components.norm_gate)  # fmt: skip
    with task_progress(8, "profile", unit="section") as advance:  # live on a terminal
        timed = functools.partial(_timed, advance=advance)
        core = [
            timed("sequences", lambda: sequences_section(ctx, history)),
            timed("balance", lambda: balance_section(ctx, history, spec)),
            timed("step time", lambda: step_time_section(ctx, probe)),
            timed("memory", lambda: memory_section(ctx, components, plan, loader.batch_at(0).to(device), sizes_model)),
            timed("communication", lambda: comm_section(ctx, plan, spec, history)),
        ]
        sections = _add(ctx, core)
        plugins = timed("plugin sections", lambda: pm.call("gem_profile_sections", profile=ctx))
        sections = _add(ctx, [s for group in plugins for s in group or ()])
        baseline = _baseline_tokens_per_s(options.baseline)
        sections = _add(ctx, [timed("mfu", lambda: mfu_section(ctx, baseline_tokens_per_s=baseline))])
        sections = _add(ctx, [timed("recommendations", lambda: recommendations_section(sections))])
    return ProfileReport(
        config_name=config.name, device=_describe(device), created=datetime.datetime.now(datetime.UTC).isoformat(
            timespec="seconds"), command=" ".join(["gem-train", *sys.argv[1:]]), sections=sections,
        config=json.loads(config.model_dump_json()),
    )  # fmt: skip


def _timed(what: str, build: Callable[[], T], *, advance: Callable[[int], None]) -> T:
    """``build()``, with a line on stderr when it starts and ends (on a large config a section can
    take minutes, and a run stopped by a time limit then shows which one it was in), then one step
    of the live display."""
    start = time.perf_counter()
    print(f"[profile] {what} ...", file=sys.stderr, flush=True)
    out = build()
    print(f"[profile] {what}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    advance(1)
    return out


def _add(ctx: ProfileContext, new: list[ProfileSection]) -> list[ProfileSection]:
    for s in new:
        if not isinstance(s, ProfileSection):
            raise PluginError(f"gem_profile_sections returned {s!r}; expected gem_model.api.ProfileSection objects")
        if s.name in ctx.sections:
            raise PluginError(f"two profile sections are named {s.name!r}; section names are unique")
        ctx.sections[s.name] = s
    return list(ctx.sections.values())


def _describe(device: object) -> str:
    import torch

    dev = torch.device(str(device))
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
