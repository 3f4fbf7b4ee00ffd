"""Errors raised by the plugin core, the config loader and the data checks.

Each one says what was wrong, where, and what is allowed.
"""

from __future__ import annotations


class GemError(Exception):
    """Base class of the framework's own errors."""


class ConfigError(GemError):
    """The run config is malformed: carries the dotted field path and the bad value."""

    def __init__(self, problems: list[tuple[str, object, str]], notes: list[str] | None = None):
        self.problems = problems
        self.notes = list(notes or [])
        """Problems that carry a message of their own (an unknown name and what is available)."""
        lines = [f"{path}: {msg} (got {value!r})" for path, value, msg in problems]
        lines += [note.replace("\n", "\n  ") for note in self.notes]
        super().__init__("invalid run config:\n  " + "\n  ".join(lines))


class DuplicateNameError(GemError):
    """Two plugins registered the same name in one registry."""


class UnknownNameError(GemError):
    """The config names a component that no installed plugin provides."""


class PluginError(GemError):
    """A plugin raised while a hook ran: names plugin, distribution and hook; the cause is chained."""


class KernelUnavailableError(GemError):
    """A configured kernel cannot run on this device or with these inputs."""


class NonFiniteError(GemError):
    """A NaN or Inf stopped the run (``gem-train`` exits 3): the loss, or a parameter a checkpoint
    would have saved. The message names the step (counted as the metrics count, from 1), the rank
    and the first non-finite parameter or gradient."""


class NonFiniteLossError(NonFiniteError):
    """Training produced a NaN or Inf loss; the step's update was not applied."""


class NonFiniteStateError(NonFiniteError):
    """A checkpoint was about to be written from non-finite parameters; it was not written."""


class RunInterrupted(GemError):
    """SIGTERM or SIGINT stopped the run after the step in progress; a checkpoint was written.

    ``gem-train`` exits ``128 + signum`` (143 for SIGTERM, 130 for SIGINT), as a shell reports a
    process the signal ended, but only once the checkpoint is complete."""

    def __init__(self, message: str, *, signum: int, checkpoint: object):
        super().__init__(message)
        self.signum, self.checkpoint = signum, checkpoint


class CheckpointError(GemError):
    """A checkpoint is missing, incomplete or does not fit this run."""


class IncompatibleCheckpointError(CheckpointError):
    """A checkpoint of another shape than this run (width, table size, global batch) or of another
    run's config: names the first mismatched tensors with both shapes and the config fields that
    differ. ``gem-train`` exits 2, as for a bad config; nothing was loaded."""


class UnsafeCheckpointError(IncompatibleCheckpointError):
    """A checkpoint whose index or values name code to run (a crafted or damaged pickle): refused
    before any of it runs, naming the file. ``gem-train`` exits 2, as for another run's checkpoint."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (no space, permission denied, a read-only file system):
    names the step, the path, the cause and the free space; the partial folder was removed and the
    checkpoints before it stay the resume point. ``gem-train`` exits 1."""


class PeerError(GemError):
    """A collective failed because a peer died or stalled past ``trainer.collective_timeout_s``, or
    the ranks disagree on the data before the first step: names the collective (or the data) and
    the rank. ``gem-train`` exits 1; torchrun then stops every other rank."""


class DeviceOutOfMemoryError(GemError):
    """A step needed more device memory than the GPU had: names the step, torch's account of the memory,
    the last checkpoint and the settings that lower the peak (:mod:`gem_model.train.out_of_memory`).
    ``gem-train`` exits 1."""
