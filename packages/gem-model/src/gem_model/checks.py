"""Every problem of a command line in one round, before any process starts.

:func:`preflight` reads the config file and the overrides, validates the schema, looks up every
component name and validates its options, then checks the constraints across fields, against the
data, the device and the processes asked for, and raises one :class:`ConfigError` listing all of
them, each with its dotted config path and the bad value (``gem-train`` exits 2). A field the schema
refuses falls back to its default for the later checks, and a constraint on a field already
refused is not reported twice.

The constraints are the functions in :data:`CHECKS`, each given a :class:`CheckContext`: add a check
by appending to that list. A check skips what it needs when that component could not be built (its
problem is reported already).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from gem_model.config import ActivationConfig, RunConfig
from gem_model.errors import ConfigError
from gem_model.footprint import MemoryShape, memory_problems
from gem_model.parallel_checks import parallel_problems

if TYPE_CHECKING:
    from gem_model.data.batch import FeatureSpec
    from gem_model.layout import Layout
    from gem_model.plugins import GemPluginManager
    from gem_model.resolve import Components

Problem = tuple[str, object, str]


@dataclass
class CheckContext:
    """What a constraint check sees. In a partial resolution a component of ``components`` is None."""

    config: RunConfig
    components: Components
    world_size: int
    """The processes of the run (all nodes)."""
    process_group: bool = True
    """Whether the run will have a process group (torchrun started it, or gem-train run will start it)."""
    local_processes: int = 1
    """The run's processes on this host, which share its memory."""
    offline: bool = False
    """Whether nothing runs here (``gem-train plan``, ``config``): the device and its memory are not checked."""

    @functools.cached_property
    def spec(self) -> FeatureSpec | None:
        source = self.components.source
        return None if source is None else source.feature_spec()

    @functools.cached_property
    def layout(self) -> Layout | str | None:
        """The planner's layout for ``world_size``, or why it cannot make one (None: no planner)."""
        import torch

        from gem_model.distributed import DistEnv

        planner = self.components.planner
        if planner is None:
            return None
        try:
            return planner.layout(DistEnv(0, self.world_size, 0, torch.device("cpu"), None))
        except (ValueError, TypeError) as exc:
            return str(exc)


Check = Callable[[CheckContext], list[Problem]]


# ------------------------------------------------------------------------------------- the checks


def heads_divide_width(ctx: CheckContext) -> list[Problem]:
    mc = ctx.config.model
    mixers = mc.cross_layers + (mc.interaction_layers if mc.use_side_features else 0)
    if mixers and mc.embedding_dim % mc.num_heads:
        return [("model.num_heads", mc.num_heads, f"must divide model.embedding_dim ({mc.embedding_dim}): the "
                 "interaction and cross layers split the width over the heads")]  # fmt: skip
    return []


def planner_drives_the_world(ctx: CheckContext) -> list[Problem]:
    config, planner, world = ctx.config, ctx.components.planner, ctx.world_size
    if planner is None:
        return []
    name = config.parallel.planner.name
    problems: list[Problem] = []
    limit = planner.max_world_size
    if limit is not None and world > limit:
        problems.append(("parallel.planner", name, f"drives at most {limit} process(es) but {world} were asked for "
                         "(--nproc x --nnodes, or torchrun's world size); pick a distributed planner such as torchrec_ddp"))  # fmt: skip
    if planner.needs_process_group and not ctx.process_group:
        problems.append(("parallel.planner", name, "needs a process group, and this process has none: run it with "
                         "`gem-train run` (it starts torchrun for such a planner, also for one process), or "
                         "`torchrun --standalone --nproc-per-node N -m gem_model run ...` (`... -m gem_model tune ...` for a search)"))  # fmt: skip
    return problems


def parallel_degrees(ctx: CheckContext) -> list[Problem]:
    """The degrees the planner chooses, against the world, the heads, the lengths, the batch and the
    precision (:mod:`gem_model.parallel_checks`). It binds the run to the planner, so it comes before
    any check that asks the planner for a layout."""
    c = ctx.components
    needed = (c.planner, c.source, c.attention, c.norm_gate, c.sequence_input, c.sequence_pool, c.next_item_loss,
              (c.precision or {}).get(ctx.config.precision.scheme.name))  # fmt: skip
    if any(part is None for part in needed):
        return []  # the run the planner is bound to needs them; their own problems are reported already
    return parallel_problems(ctx.config, ctx.components, ctx.world_size, ranks_per_node=ctx.local_processes)


def sequences_fit(ctx: CheckContext) -> list[Problem]:
    mc, spec = ctx.config.model, ctx.spec
    if spec is None:
        return []
    need = spec.max_history + int(mc.use_candidate) + int(mc.context_token)
    if mc.max_seq_len < need:
        return [("model.max_seq_len", mc.max_seq_len, f"is shorter than the data's longest history "
                 f"({spec.max_history}, data.source {ctx.config.data.source.name!r}) plus the candidate "
                 f"({int(mc.use_candidate)}) plus the context token ({int(mc.context_token)}): it must be at least {need}")]  # fmt: skip
    return []


def data_has_what_the_model_needs(ctx: CheckContext) -> list[Problem]:
    """The model's options that need something of the data: a candidate, side features, timestamps."""
    mc, spec, source = ctx.config.model, ctx.spec, ctx.config.data.source.name
    if spec is None:
        return []
    problems: list[Problem] = []
    if mc.use_candidate and not spec.candidates:
        problems.append(("model.use_candidate", True, f"data.source {source!r} gives no candidate item per sample; "
                         "set model.use_candidate=false, or give the data a candidate (the parquet source: "
                         "data.source.options.columns.candidate)"))  # fmt: skip
    features = len(spec.pooled) + int(spec.num_dense > 0)
    if mc.context_token and not features:
        problems.append(("model.context_token", True, f"is made from the side features, and data.source {source!r} "
                         "has none (no pooled or dense feature); set model.context_token=false, or configure the "
                         "source's side features (the parquet source: pooled, dense)"))  # fmt: skip
    if mc.relative_time_bias and not spec.timestamps:
        problems.append(("model.relative_time_bias", True, f"needs each event's time, and data.source {source!r} "
                         "gives none; set model.relative_time_bias=false, or give the data times (the parquet "
                         "source: columns.history_time and columns.request_time)"))  # fmt: skip
    return problems


def kernels_support_the_model(ctx: CheckContext) -> list[Problem]:
    mc, attention = ctx.config.model, ctx.components.attention
    if attention is None:
        return []
    name = ctx.config.kernels.jagged_attention.name
    problems: list[Problem] = []
    for wanted, supported in (("relative_position_bias", attention.supports_position_bias),
                              ("relative_time_bias", attention.supports_time_bias)):  # fmt: skip
        if getattr(mc, wanted) and not supported:
            problems.append((f"model.{wanted}", True, f"needs an attention kernel that supports it, and "
                             f"kernels.jagged_attention {name!r} does not; pick one that does (`gem-train "
                             "plugins --options` lists the kernels)"))  # fmt: skip
    return problems


def device_is_there(ctx: CheckContext) -> list[Problem]:
    if ctx.offline or ctx.config.trainer.device != "cuda":
        return []
    import torch

    if not torch.cuda.is_available():
        build = f"torch {torch.__version__}, " + ("built without CUDA" if torch.version.cuda is None else
                                                 f"CUDA {torch.version.cuda}, but no device is visible")  # fmt: skip
        return [("trainer.device", "cuda", f"no CUDA device here ({build}); use trainer.device=cpu, or auto (the GPU "
                 "where there is one)")]  # fmt: skip
    return []


def memory_fits(ctx: CheckContext) -> list[Problem]:
    """Tables, dense state and the first batch's activations against the device's memory (:mod:`gem_model.footprint`)."""
    if ctx.offline or ctx.spec is None:
        return []
    config = ctx.config
    try:
        first = ctx.components.source.lengths(0, config.data.global_batch_size)
    except Exception:  # a source that cannot say yet: its data errors come when the run reads it
        first = None
    layout = ctx.layout
    dp = layout.dp_degree if layout is not None and not isinstance(layout, str) else ctx.world_size
    wanted = config.precision.activation_dtype
    scheme = (ctx.components.precision or {}).get(config.precision.scheme.name)
    bf16 = wanted == "bfloat16" or (wanted == "auto" and scheme is not None and scheme.activation_dtype == "bfloat16")
    plain = config.activation.policy.name == ActivationConfig().policy.name and not config.activation.overrides
    shape = MemoryShape(ctx.spec, ctx.world_size, dp, ctx.local_processes, first, bf16, plain)
    return memory_problems(config, shape)


CHECKS: list[Check] = [
    heads_divide_width,
    parallel_degrees,
    planner_drives_the_world,
    sequences_fit,
    data_has_what_the_model_needs,
    kernels_support_the_model,
    device_is_there,
    memory_fits,
]
"""The constraint checks, in order. Append to it to add one (it runs wherever runs are checked)."""


def run_problems(
    config: RunConfig,
    components: Components,
    world_size: int,
    *,
    process_group: bool = True,
    local_processes: int | None = None,
    offline: bool = False,
) -> list[Problem]:
    """Every constraint ``config`` breaks with ``components`` at ``world_size`` processes."""
    local = local_processes if local_processes is not None else _local_processes(world_size)
    ctx = CheckContext(config, components, world_size, process_group, local, offline)
    return [p for check in CHECKS for p in check(ctx)]


def check_run(
    config: RunConfig,
    components: Components,
    world_size: int,
    *,
    process_group: bool = True,
    local_processes: int | None = None,
    offline: bool = False,
) -> None:
    """Raise one :class:`ConfigError` listing every cross-field and data constraint ``config`` breaks."""
    problems = run_problems(config, components, world_size, process_group=process_group,
                            local_processes=local_processes, offline=offline)  # fmt: skip
    if problems:
        raise ConfigError(problems)


def _local_processes(world_size: int) -> int:
    """Under torchrun, the processes torchrun started on this host; else this one."""
    return max(1, min(world_size, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


# --------------------------------------------------------------------------------- one round of all


def preflight(
    path: str | Path | None,
    overrides: Sequence[str],
    pm: GemPluginManager,
    *,
    world_size: int = 1,
    process_group: bool = True,
    local_processes: int = 1,
    offline: bool = False,
    before: Sequence[Problem] = (),
) -> tuple[RunConfig, Components]:
    """The config and its components, or one :class:`ConfigError` with every problem of the command
    line: ``before`` (e.g. the launch options'), the file, the overrides, the schema, the names and
    options of the components, and the constraints of :data:`CHECKS`."""
    from gem_model.config_io import apply_overrides_collecting, read_file, validate_leniently
    from gem_model.resolve import Components, resolve_partially

    problems: list[Problem] = list(before)
    try:
        data = read_file(path) if path is not None else {}
    except ConfigError as exc:  # nothing more can be checked without the file
        raise ConfigError(problems + exc.problems) from None
    data, bad_overrides = apply_overrides_collecting(data, overrides)
    config, schema = validate_leniently(data)
    problems += bad_overrides + schema
    notes: list[str] = []
    components = None
    if config is not None:
        resolution = resolve_partially(config, pm)
        notes, problems = resolution.unknown, problems + resolution.bad
        refused = [p for p, _, _ in problems]
        partial = Components(**resolution.built)
        for problem in run_problems(config, partial, world_size, process_group=process_group,
                                    local_processes=local_processes, offline=offline):  # fmt: skip
            if not any(_within(problem[0], r) for r in refused):
                problems.append(problem)
        components = resolution.components()
    if problems or notes:
        raise ConfigError(problems, notes)
    assert config is not None and components is not None
    return config, components


def _within(path: str, refused: str) -> bool:
    """Whether ``path`` is ``refused`` or inside it (a constraint on a field the schema refused)."""
    return path == refused or path.startswith(refused + ".") or refused.startswith(path + ".")
