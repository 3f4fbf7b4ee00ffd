"""Errors raised by the plugin core, the config loader and the data checks.

Each one says what was wrong, where, and what is allowed.
"""

from __future__ import annotations


class GemError(Exception):
    """Base class of the framework's own errors."""


class ConfigError(GemError):
    """The run config is malformed: carries the dotted field path and the bad value."""

    def __init__(self, problems: list[tuple[str, object, str]]):
        self.problems = problems
        lines = [f"{path}: {msg} (got {value!r})" for path, value, msg in problems]
        super().__init__("invalid run config:\n  " + "\n  ".join(lines))


class DuplicateNameError(GemError):
    """Two plugins registered the same name in one registry."""


class UnknownNameError(GemError):
    """The config names a component that no installed plugin provides."""


class PluginError(GemError):
    """A plugin raised while a hook ran: names plugin, distribution and hook; the cause is chained."""


class KernelUnavailableError(GemError):
    """A configured kernel cannot run on this device or with these inputs."""


class NonFiniteLossError(GemError):
    """Training produced a NaN or Inf loss."""


class CheckpointError(GemError):
    """A checkpoint is missing, incomplete or does not fit this run."""
