"""What profile sections and profile commands get: :class:`ProfileContext`, :class:`MeasuredSteps`
and :class:`ProfileCommand` (the ``gem_profile_sections`` and ``gem_profile_commands`` hooks)."""

from __future__ import annotations

import argparse
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
