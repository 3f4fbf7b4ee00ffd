"""A plugin for the config-check tests: a planner with the default data-parallel layout (one
data-parallel rank per process), so a global batch that does not divide over the ranks is refused
before torchrun starts. Its runs are never started: the check stops them first."""

from __future__ import annotations

from typing import ClassVar

from gem_model.api import hookimpl
from gem_model.testing import Single


class DataParallelCheckOnly(Single):
    name: ClassVar[str] = "inline_dp"
    max_world_size: ClassVar[int | None] = None


@hookimpl
def gem_register_parallel_planners():
    return [DataParallelCheckOnly]
