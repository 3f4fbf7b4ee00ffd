"""Third-party warnings that say nothing about a gem-train run, kept off the terminal.

torch, torchrec and fbgemm-gpu warn their own authors and users about their internals: deprecations
of calls our dependencies make, advice for their own planner's dry runs, build facts of a kernel.
None of those is something a user of ``gem-train`` can act on, and a distributed run printed about
a dozen of them per rank. Each entry below names one warning precisely, by its message and where it
comes from, and says why it does not matter for a run; anything else still reaches the terminal.
A warning that does matter for a run is not listed here: the core says it once, on rank 0, in its
own words.

:func:`install` is called first thing by ``gem-train`` (and so in every process torchrun starts);
:data:`SILENCED` is the list, tested one by one in ``tests/test_quiet.py``.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Silenced:
    """One third-party warning: a Python warning (``category`` set) or a log record (``logger`` set)."""

    message: str
    """A regular expression matched at the start of the message (``re.match``)."""
    why: str
    """Why it says nothing about a gem-train run."""
    category: type[Warning] | None = None
    module: str = ""
    """For a Python warning: a regular expression matched against the module it is attributed to."""
    logger: str | None = None
    """For a log record: the name of the logger that emits it (``root`` for the root logger)."""


SILENCED: tuple[Silenced, ...] = (
    Silenced(
        logger="torchrec.distributed.planner.types",
        message=r"The topology was constructed directly rather than via TopologyFactory",
        why="torchrec asks its callers to build a Topology through its factory; ours is built from the "
        "layout the planner already checked, and the job does not fail",
    ),
    Silenced(
        logger="torchrec.distributed.planner.storage_reservations",
        message=r"There is a known issue with TorchRec's dense tensor size calculation in dry run",
        why="torchrec's storage reservation over-estimates dense tensors in a dry run; our tables are small "
        "against the reservation, and gem-train checks the config's own memory before the run is built",
    ),
    Silenced(
        category=FutureWarning,
        module=r"torchrec\.distributed\.planner",
        message=r"HeuristicalStorageReservation is known to cause issues",
        why="the same over-estimate, as a deprecation of torchrec's default storage reservation",
    ),
    Silenced(
        category=FutureWarning,
        module=r"torchrec\.distributed",
        message=r"`broadcast_buffers` is deprecated",
        why="torchrec's DistributedModelParallel passes a deprecated DDP argument; the model has no buffers "
        "that ranks hold apart",
    ),
    Silenced(
        category=FutureWarning,
        # attributed to whichever code calls a ShardedTensor method: torchrec's, torch's, or ours
        # reading a checkpoint's tensor sizes (gem_model.train.compat)
        module=r"(torch|torchrec|gem_model|gem_parallel)\.",
        message=r"Please use DTensor instead and we are deprecating ShardedTensor",
        why="torchrec's sharded tables are ShardedTensors; a deprecation inside torchrec",
    ),
    Silenced(
        category=UserWarning,
        module=r"torch(rec)?\.",
        message=r"`_get_pg_default_device` will be deprecated",
        why="a deprecated torch call inside torchrec",
    ),
    Silenced(
        category=UserWarning,
        module=r"torch\.distributed",
        message=r"barrier\(\): using the device under current context",
        why="each rank sets its CUDA device before the group starts (gem_model.distributed), so the "
        "device under the current context is the rank's own",
    ),
    Silenced(
        category=UserWarning,
        module=r"torch\.autograd",
        message=r"TBE B200 optimization:",
        why="fbgemm-gpu reports, from inside its CUDA backward, whether a B200-only tuning is on; a build fact",
    ),
    Silenced(
        logger="root",
        message=r"\s*(\x1b\[\d+m)?\s*_fbgemm_torch_compat_table has no entry for",
        why="fbgemm-gpu's version table does not know its own local build's version string; a mismatch it "
        "does know of is a different message and still shows",
    ),
    Silenced(
        logger="torch.fx._symbolic_trace",
        message=r"is_fx_tracing will return true for both fx.symbolic_trace and torch.export",
        why="torch.fx's advice to torchrec's authors, logged once when torchrec's code asks whether it is traced",
    ),
    Silenced(
        category=UserWarning,
        module=r"torch\.profiler",
        message=r"Warning: Profiler clears events at the end of each cycle",
        why="gem-train profile reads each cycle's events when it ends",
    ),
)


class _DropRecords(logging.Filter):
    def __init__(self, patterns: list[re.Pattern[str]]):
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = str(record.msg)
        return not any(p.match(message) for p in self.patterns)


def install() -> None:
    """Keep every :data:`SILENCED` warning off the terminal (idempotent: filters are added once)."""
    by_logger: dict[str, list[re.Pattern[str]]] = {}
    for s in SILENCED:
        if s.logger is not None:
            by_logger.setdefault(s.logger, []).append(re.compile(s.message))
        else:
            assert s.category is not None
            warnings.filterwarnings("ignore", message=s.message, category=s.category, module=s.module)
    for name, patterns in by_logger.items():
        logger = logging.getLogger(None if name == "root" else name)
        if not any(isinstance(f, _DropRecords) for f in logger.filters):
            logger.addFilter(_DropRecords(patterns))
