"""One run per output directory: a lock held for the whole run.

Rank 0 holds ``<output_dir>/run.lock`` (``flock``, exclusive) from before the model is built until
the run ends, and writes its pid, host and start time into it. A second run into the same directory
finds it held and stops at once (exit 2) naming that pid and host; so no run ever touches another
live run's checkpoints, partial or complete. The kernel drops a ``flock`` when its process ends,
however it ends (SIGKILL included), so a lock file left by a killed run is stale: the next run takes
it over and says whose it was. Locks work across hosts where the file system supports ``flock``
(local disks, NFS through its lock manager); one that does not is refused with exit 2.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from gem_model.errors import ConfigError

LOCK = "run.lock"


class OutputDirRefused(ConfigError):
    """The output directory cannot be taken (another live run holds it, or it cannot be locked).

    Rank 0's refusal travels in the start-up all-reduce, so every rank raises it after the same
    collective: the ranks stop together and may leave the process group cleanly (after a barrier).
    Destroying a gloo group while the peer still holds its end aborts that peer (SIGABRT), which
    would turn the refusal's exit 2 into a crash."""

    def anew(self) -> OutputDirRefused:
        """The same refusal as a new exception, for a frame that holds this one in a local: raising
        the local itself makes a cycle (exception -> traceback -> frame -> exception) that keeps the
        half-built run, and with it the process group's threads, alive past the group's teardown."""
        return OutputDirRefused(self.problems, self.notes)


@dataclass(frozen=True)
class Holder:
    pid: int | None
    host: str
    started: str

    @classmethod
    def me(cls) -> Holder:
        started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        return cls(os.getpid(), socket.gethostname(), started)

    @classmethod
    def read(cls, path: Path) -> Holder | None:
        try:
            record = json.loads(path.read_text())
            return cls(int(record["pid"]), str(record["host"]), str(record["started"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def __str__(self) -> str:
        return f"pid {self.pid} on host {self.host} (started {self.started})"


def _refusal(out: Path, holder: Holder | None) -> OutputDirRefused:
    who = str(holder) if holder is not None else "a process that has not yet written its pid and host"
    return OutputDirRefused(
        [("trainer.output_dir", str(out), f"is in use by another run: {who}, which holds {out / LOCK}. Wait for "
          "it to end, or choose another trainer.output_dir (nothing was touched)")]
    )  # fmt: skip


def _unsupported(out: Path, exc: OSError) -> OutputDirRefused:
    return OutputDirRefused(
        [("trainer.output_dir", str(out), f"cannot be locked ({exc.strerror}): its file system does not support "
          "flock, so one run per directory cannot be ensured there; choose a directory on one that does")]
    )  # fmt: skip


def check_free(out: Path) -> None:
    """Raise (exit 2) when a live run holds ``out``'s lock. A shared lock, let go at once: checks
    by several ranks of one run do not collide, and only a holder of the exclusive lock refuses."""
    path = out / LOCK
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _refusal(out, Holder.read(path)) from None
    except OSError as exc:
        raise _unsupported(out, exc) from None
    finally:
        os.close(fd)  # closing lets go of the shared lock


class OutputLock:
    """The output directory's lock, held by rank 0 from :meth:`acquire` to :meth:`release`."""

    def __init__(self, out: Path):
        self.out, self.path = out, out / LOCK
        self._fd: int | None = None
        self.stale: Holder | None = None  # the killed run whose lock file this run took over

    def acquire(self) -> OutputDirRefused | None:
        """Take the lock; the refusal (another live run holds it) is returned, not raised, so the
        other ranks can learn it in the start-up collective first."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return _refusal(self.out, Holder.read(self.path))
        except OSError as exc:
            os.close(fd)
            return _unsupported(self.out, exc)
        self.stale = Holder.read(self.path)
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(Holder.me().__dict__).encode())
        os.fsync(fd)
        self._fd = fd
        return None

    def took_over(self) -> str | None:
        """A line to tell, when the lock file was a killed run's."""
        if self.stale is None or self.stale.pid == os.getpid():
            return None
        return f"took over {self.path} from {self.stale}, which no longer runs"

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)  # an empty file: no run holds it
        os.close(self._fd)  # lets go of the lock
        self._fd = None


def refusal_seen_by_peer(out: Path) -> OutputDirRefused:
    """The refusal, on a rank that learnt in the start-up collective that rank 0 could not lock ``out``."""
    return _refusal(out, Holder.read(out / LOCK))
