"""What profile sections and profile commands get: :class:`ProfileContext`, :class:`MeasuredSteps`
and :class:`ProfileCommand` (the ``gem_profile_sections`` and ``gem_profile_commands`` hooks)."""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from gem_model.config import RunConfig
    from gem_model.profiling.report import ProfileSection


@dataclass
class MeasuredSteps:
    """A few real training steps of the profiled config (the step-time section runs them)."""

    step_seconds: list[float]
    """Wall time of each measured step (warm-up steps left out)."""
    tokens: list[int]
    """Real tokens of each measured step's global batch."""
    flops: list[float]
    """Training FLOPs of each measured step's global batch (:mod:`gem_model.model.flops`)."""
    comm_strategy: str
    world_size: int = 1
    """Processes that ran the steps."""
    comm_per_step: dict[str, float] = field(default_factory=dict)
    """Per-step means of the differences of ``CommStrategy.measurements()`` around each step
    (``<kind>.bytes``, ``<kind>.calls``, ``<kind>.seconds``); empty when the strategy measures nothing."""
    peak_memory_bytes: int | None = None
    """The device allocator's peak over the measured steps; None where the device reports none (CPU)."""
    unprofiled_step_seconds: list[float] = field(default_factory=list)
    """Wall time of the warm-up steps after the first, which ran without the profiler (the first
    compiles and warms up): step time and MFU come from these where there are any, since the
    profiler's own host cost is in the measured steps' time (on a CPU it is most of it)."""
    unprofiled_tokens: list[int] = field(default_factory=list)
    unprofiled_flops: list[float] = field(default_factory=list)
    power: dict | None = None
    """On a GPU: its power draw and SM clock during the unprofiled steps
    (:func:`gem_model.profiling.device_power.summarize`); None elsewhere or without samples."""
    power_failure: str | None = None
    """Why a GPU's power was not sampled (no ``nvidia-smi``, it failed), where it was tried."""


@dataclass
class ProfileContext:
    """The narrow view of a profile that ``gem_profile_sections`` implementations get.

    - ``config``: the validated run config being profiled.
    - ``plugins``: the plugin manager (its registries: every registered scheme, policy, balancer).
    - ``device``: the device the profile runs on.
    - ``world_size``: the processes the profile assumes (``--world``, or the launched world).
    - ``dp_degree``: the data-parallel degree of the planner's layout for ``world_size``.
    - ``batches``: how many global batches the data sections read (from step 0).
    - ``output_dir``: where the report is written.
    - ``measured``: :class:`MeasuredSteps` once the step-time section ran, else None.
    - ``sections``: the sections made so far, by name (the core's come first).
    - ``selected``: the section names ``--sections`` asked for (None: all); :meth:`wants` reads it.
    - :meth:`model`: the config's model, built once and shared by the sections that run it.
    - :meth:`memory_fit`: what the run would need per rank under another precision config, against
      the device's memory.
    """

    config: RunConfig
    plugins: Any
    """The :class:`~gem_model.plugins.GemPluginManager` (not imported here: hookspecs import this module)."""
    device: torch.device
    world_size: int
    dp_degree: int
    batches: int
    output_dir: Path
    measured: MeasuredSteps | None = None
    sections: dict[str, ProfileSection] = field(default_factory=dict)
    selected: frozenset[str] | None = None
    build_model: Callable[[], Any] | None = None
    """What :meth:`model` calls the first time (the runner sets it: :func:`gem_model.profiling.shared_model.initial_model`)."""
    fit_memory: Callable[[Any], Any] | None = None
    """What :meth:`memory_fit` calls (the runner sets it: :func:`gem_model.profiling.memory.precision_memory`)."""
    _model: Any = field(default=None, repr=False)

    def wants(self, name: str) -> bool:
        """Whether the section ``name`` is to be made (``gem-train profile --sections``)."""
        return self.selected is None or name in self.selected

    def model(self) -> Any:
        """The config's :class:`~gem_model.model.gem.GemModel` on ``device``: float32, unconverted, its
        tables drawn (rank 0's initialisation). Built on the first call and shared: at 25 GB of tables
        each section building its own cost a table draw and a copy of the tables' memory. Never change
        it; a section that converts or wraps modules works on :func:`copy_sharing_tables` of it."""
        if self._model is None:
            if self.build_model is None:
                raise RuntimeError("this ProfileContext has no build_model; gem-train profile sets it (to "
                                   "gem_model.profiling.shared_model.initial_model)")  # fmt: skip
            self._model = self.build_model()
        return self._model

    def memory_fit(self, precision: Any) -> Any:
        """The :class:`~gem_model.profiling.memory.MemoryFit` of the run with ``precision`` (a
        :class:`~gem_model.config.PrecisionConfig`) in place of its own: one step's activations
        measured under it on ``device``, with the static bytes or the measured peak, against the
        device's memory. Raises where no ``fit_memory`` was given."""
        if self.fit_memory is None:
            raise RuntimeError("this ProfileContext has no fit_memory; gem-train profile sets it (to "
                               "gem_model.profiling.memory.precision_memory)")  # fmt: skip
        return self.fit_memory(precision)


def copy_sharing_tables(model: Any) -> Any:
    """A deep copy of ``model`` whose embedding-table modules, and every tensor they hold, are the
    original's (not copied), wherever else the model refers to them."""
    memo: dict[int, Any] = {}
    for module in model.table_modules().values():
        for m in module.modules():
            memo[id(m)] = m
        for t in [*module.parameters(), *module.buffers()]:
            memo[id(t)] = t
    return copy.deepcopy(model, memo)


@dataclass(frozen=True)
class ProfileCommand:
    """A ``gem-train profile <name>`` subcommand a plugin adds (``gem_profile_commands``).

    ``add_arguments(parser)`` declares its options on its own argparse parser; ``run(args,
    plugins)`` carries it out and returns the exit status.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Any], int]
