"""The order of a profile: the real steps first, then every section on rank 0 alone.

1. step time: ``warmup + steps`` real training steps (every rank of a torchrun launch takes part;
   the process group is gone when they end), which also gives the measured memory peak, the comm
   strategy's measurements and the MFU inputs; skipped when ``--sections`` names neither
   ``step_time`` nor ``mfu``;
2. on global rank 0: sequences, balance, memory, communication (the core's), the plugins'
   sections (``gem_profile_sections``, each plugin on its own), MFU, and last the recommendations.

``--sections a,b`` makes only those (names checked against the registered ones); each section (each
plugin's call) runs under ``--section-budget`` seconds and is cut off past it (:mod:`.cutoff`). A
section that is cut off or raises is reported as such, the others still run, and ``profile.json``
is rewritten after every section: a profile stopped from outside keeps what it finished.
"""

from __future__ import annotations

import datetime
import functools
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gem_model.config import RunConfig
from gem_model.distributed import launched_by_torchrun
from gem_model.errors import ConfigError, PluginError
from gem_model.plugins import GemPluginManager
from gem_model.profiling.balance import balance_section
from gem_model.profiling.comm import comm_section
from gem_model.profiling.context import ProfileContext
from gem_model.profiling.cutoff import SectionTimeout, check_can_limit, time_limit
from gem_model.profiling.memory import memory_section
from gem_model.profiling.mfu import mfu_section
from gem_model.profiling.parts import RunParts, make_context
from gem_model.profiling.recommend import recommendations_section
from gem_model.profiling.render import JSON_NAME, write_outputs
from gem_model.profiling.report import ProfileReport, ProfileSection
from gem_model.profiling.sequences import read_history, sequences_section
from gem_model.profiling.step_probe import measure_steps
from gem_model.profiling.step_time import step_time_section
from gem_model.resolve import resolve_components
from gem_model.train.progress import task_progress

CORE_SECTIONS = ("sequences", "balance", "step_time", "memory", "communication")
LAST_SECTIONS = ("mfu", "recommendations")
STEP_SECTIONS = frozenset({"step_time", "mfu"})
"""The sections that need the measured training steps (plugin sections read them when they ran)."""
UNFINISHED = ("timed_out", "failed")


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
    sections: tuple[str, ...] | None = None
    """The sections to make (None: every registered one)."""
    section_budget_s: float | None = None
    """Seconds each section (each plugin's call) may take before it is cut off (None: no limit)."""

    def check(self) -> None:
        problems: list[tuple[str, object, str]] = []
        for flag, value, least in (("--batches", self.batches, 1), ("--steps", self.steps, 1), ("--warmup", self.warmup, 0)):
            if value < least:
                problems.append((flag, value, f"must be at least {least}"))
        if self.world is not None and self.world < 1:
            problems.append(("--world", self.world, "must be at least 1"))
        if self.sections is not None and not self.sections:
            problems.append(("--sections", "", "name at least one section"))
        if problems:
            raise ConfigError(problems)
        check_can_limit(self.section_budget_s)


def registered_sections(pm: GemPluginManager) -> dict[str, str]:
    """Every section name ``--sections`` accepts -> who makes it (``core`` or the plugin's name)."""
    out = dict.fromkeys(CORE_SECTIONS, "core")
    for plugin, names in _declared(pm).items():
        for name in names:
            if name in out:
                raise PluginError(f"plugin {plugin!r} declares the profile section {name!r}, which {out[name]} "
                                  "makes already; section names are unique")  # fmt: skip
            out[name] = plugin
    return {**out, **dict.fromkeys(LAST_SECTIONS, "core")}


def selected_sections(pm: GemPluginManager, requested: tuple[str, ...] | None) -> frozenset[str] | None:
    if requested is None:
        return None
    known = registered_sections(pm)
    unknown = [n for n in requested if n not in known]
    if unknown:
        def who(plugin: str) -> str:
            return plugin if plugin == "core" else f"plugin {plugin} of {pm.provider(plugin).distribution}"

        listed = ", ".join(f"{n} ({who(plugin)})" for n, plugin in known.items())
        raise ConfigError([("--sections", ",".join(unknown), f"no such profile section; the registered ones: {listed}")])
    return frozenset(requested)


def _declared(pm: GemPluginManager) -> dict[str, list[str]]:
    """Plugin name -> the section names it declares (``gem_profile_section_names``)."""
    hook = "gem_profile_section_names"
    return {name: list(pm.call_plugin(hook, name) or ()) for name in pm.implementers(hook)}


def _baseline_tokens_per_s(path: Path | None) -> float | None:
    if path is None:
        return None
    report = ProfileReport.from_json((path / "profile.json").read_text())
    return float(report.section("mfu").summary["tokens_per_s"])


def run_profile(config: RunConfig, pm: GemPluginManager, options: ProfileOptions) -> ProfileReport | None:
    """Profile ``config``; the report on global rank 0, None on the other ranks."""
    options.check()
    selected = selected_sections(pm, options.sections)
    components = resolve_components(config, pm)
    launched = int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1
    world = options.world or launched
    limit = components.planner.max_world_size
    if limit is not None and world > limit:
        raise ConfigError([("--world", world, f"parallel.planner {components.planner.name!r} drives at most {limit}")])
    steps = selected is None or bool(selected & STEP_SECTIONS)
    probe = None
    if steps:
        start = time.perf_counter()
        print(f"[profile] training steps ({options.warmup} + {options.steps} measured) ...", file=sys.stderr, flush=True)
        probe = measure_steps(config, pm, warmup=options.warmup, steps=options.steps)
        print(f"[profile] training steps: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    if int(os.environ.get("RANK", "0")) != 0:
        return None
    _release_memory()  # the measured run's model and tables, before the sections build theirs
    ctx, parts = make_context(config, pm, components, world=world, batches=options.batches, out=options.out,
                              measured=None if probe is None else probe.measured(), selected=selected)  # fmt: skip
    made = _Sections(ctx, options, ctx.device)
    try:
        _core_sections(ctx, parts, made, probe)
        for plugin in pm.implementers("gem_profile_sections"):
            declared = made.declared.get(plugin)
            if selected is None or (declared and selected & set(declared)):
                made.run(f"plugin {plugin}", [n for n in declared or [plugin] if ctx.wants(n)],
                         lambda p=plugin: pm.call_plugin("gem_profile_sections", p, profile=ctx) or [])  # fmt: skip
        if ctx.wants("mfu"):
            baseline = _baseline_tokens_per_s(options.baseline)
            made.run("mfu", ["mfu"], lambda: [mfu_section(ctx, baseline_tokens_per_s=baseline)])
        if ctx.wants("recommendations"):
            made.run("recommendations", ["recommendations"], lambda: [recommendations_section(list(ctx.sections.values()))])
    except BaseException:
        if ctx.sections:  # nothing lost: the sections that finished, with their plots and HTML
            write_outputs(made.report(), options.out)
        raise
    finally:
        made.close()
    return made.report()


def _core_sections(ctx: ProfileContext, parts: RunParts, made: _Sections, probe: Any) -> None:
    components = parts.components

    @functools.cache
    def history() -> list[Any]:
        return read_history(ctx, components.source)

    spec = components.source.feature_spec()
    builders: dict[str, Callable[[], ProfileSection]] = {
        "sequences": lambda: sequences_section(ctx, history()),
        "balance": lambda: balance_section(ctx, history(), spec),
        "step_time": lambda: step_time_section(ctx, probe),
        "memory": lambda: memory_section(ctx, components, parts.plan, parts.first_batch, parts.sizes),
        "communication": lambda: comm_section(ctx, parts.plan, spec, history()),
    }
    for name in CORE_SECTIONS:
        if ctx.wants(name):
            made.run(name.replace("_", " "), [name], lambda build=builders[name]: [build()])


def _release_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Sections:
    """Runs sections one at a time under the budget, with the live display, and keeps the report."""

    def __init__(self, ctx: ProfileContext, options: ProfileOptions, device: Any):
        self.ctx, self.options, self.device = ctx, options, device
        self.declared = _declared(ctx.plugins)
        self.created = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        total = sum(ctx.wants(n) for n in registered_sections(ctx.plugins))
        self._display = task_progress(max(total, 1), "profile", unit="section")
        self._advance = self._display.__enter__()  # live on a terminal

    def run(self, what: str, names: list[str], build: Callable[[], list[ProfileSection]]) -> None:
        """``build()``, with a line on stderr when it starts and ends (on a large config a section can
        take minutes, and a run stopped by a time limit then shows which one it was in)."""
        start = time.perf_counter()
        print(f"[profile] {what} ...", file=sys.stderr, flush=True)
        try:
            with time_limit(self.options.section_budget_s, f"section {what}"):
                sections = build()
            end = f"{time.perf_counter() - start:.1f} s"
        except SectionTimeout as exc:
            sections = [_unfinished(n, "timed_out", str(exc), time.perf_counter() - start) for n in names]
            end = f"cut off after {time.perf_counter() - start:.1f} s"
            _release_memory()
        except Exception as exc:  # one section's failure is reported; the others still run
            message = f"{type(exc).__name__}: {exc}"
            sections = [_unfinished(n, "failed", message, time.perf_counter() - start) for n in names]
            end = f"failed after {time.perf_counter() - start:.1f} s: {message}"
            _release_memory()
        print(f"[profile] {what}: {end}", file=sys.stderr, flush=True)
        _add(self.ctx, [s for s in sections if not isinstance(s, ProfileSection) or self.ctx.wants(s.name)])
        self._advance(len(names))
        self.options.out.mkdir(parents=True, exist_ok=True)
        (self.options.out / JSON_NAME).write_text(self.report().to_json())

    def report(self) -> ProfileReport:
        config = self.ctx.config
        return ProfileReport(
            config_name=config.name, device=_describe(self.device), created=self.created,
            command=" ".join(["gem-train", *sys.argv[1:]]), sections=list(self.ctx.sections.values()),
            config=json.loads(config.model_dump_json()),
        )  # fmt: skip

    def close(self) -> None:
        self._display.__exit__(None, None, None)


def unfinished(report: ProfileReport) -> dict[str, str]:
    """Section name -> ``timed_out`` or ``failed``, for the sections that did not finish."""
    return {s.name: s.summary["status"] for s in report.sections if s.summary.get("status") in UNFINISHED}


def _unfinished(name: str, status: str, message: str, seconds: float) -> ProfileSection:
    what = "cut off" if status == "timed_out" else "failed"
    return ProfileSection(name=name, title=f"{name}: {what} after {seconds:.1f} s",
                          summary={"status": status, "seconds": seconds, "error": message}, notes=[message])  # fmt: skip


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
